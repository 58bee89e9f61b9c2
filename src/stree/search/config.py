"""SearchConfig: one config for every strategy (stree.search.strategies.STRATEGIES names them)."""
import math
import numbers
from dataclasses import dataclass, field

from ..checks import check_float, check_int
from ..sampling import Sampler
from .allocation import ETS_WEIGHTS
from .answers import AGGREGATIONS
from .batched import check_seed
from .strategies import STRATEGIES
from .strategies.spec_beam import BeamOptions


@dataclass
class SearchConfig:
    """The settings of a search (every field below); a bad value raises ValueError naming it when the config is
    made. Token ids (step_delimiter_ids, eos_token_ids) are checked against the policy's vocabulary by
    tree_search / tree_search_batch."""
    strategy: str = "rebase"          # best_of_n | beam | dvts | rebase | ets | spec_beam
    width: int = 16                   # N: continuations per step
    beam_width: int = 0               # beam / DVTS / spec_beam: trajectories (subtrees) kept; 0 = round(sqrt(N))
    max_steps: int = 8
    temperature: float = 1.0
    top_p: float = None
    step_delimiter_ids: tuple = ()
    step_max_tokens: int = 64
    eos_token_ids: tuple = ()
    rebase_temperature: float = 0.2
    lambda_b: float = 1.0             # ETS: weight of the retained-node term
    lambda_d: float = 1.0             # ETS: weight of the cluster-coverage term
    cluster_threshold: float = 0.3    # ETS: cosine distance cut of the step-embedding clusters
    ets_weights: str = "rebase"       # ETS outcome weights: "rebase" (REBASE's counts / width, as ETS) or "softmax"
    ets_costs: str = "nodes"          # ETS node term: "nodes" (one per node, as ETS) or "bytes" (TreeMemory's bytes)
    aggregation: str = "last"         # trajectory score from step scores: last | min | prod
    seed: int = 0                     # candidate with sibling indices `key` draws from candidate_generator(seed, key)
    leaf_states: str = "keep"         # keep: every leaf holds its SSM snapshot until the strategy chooses;
                                      # replay: leaves keep tokens only, chosen ones are rebuilt from their parent's
                                      # snapshot (one forward pass over their step): fewer snapshots, more compute
    dedup: bool = True                # candidates from one state share a row (one forward) while their tokens agree
    spec_beam: BeamOptions = field(default_factory=BeamOptions)  # strategy="spec_beam" only

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {self.strategy!r}")
        for name, least in (("width", 1), ("max_steps", 1), ("step_max_tokens", 1), ("beam_width", 0)):
            check_int(name, getattr(self, name), least)  # beam_width 0: round(sqrt(width))
        for name in ("temperature", "rebase_temperature"):  # a search samples its steps: no greedy temperature 0
            check_float(name, getattr(self, name), 0.0, strict=True)
        Sampler(self.temperature, top_p=self.top_p)  # its ValueError names a top_p outside (0, 1]
        for name in ("lambda_b", "lambda_d", "cluster_threshold"):
            check_float(name, getattr(self, name), 0.0, strict=False)
        for name in ("step_delimiter_ids", "eos_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, (tuple, list, set, frozenset)) or any(
                    isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in ids):
                raise ValueError(f"{name} must be a tuple of token ids (ints >= 0), got {ids!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        check_seed(self.seed)
        if self.ets_weights not in ETS_WEIGHTS or self.ets_costs not in ("nodes", "bytes"):
            raise ValueError(f"ets_weights must be one of {ETS_WEIGHTS} and ets_costs 'nodes' or 'bytes', got "
                             f"{self.ets_weights!r} and {self.ets_costs!r}")
        if self.leaf_states not in ("keep", "replay"):
            raise ValueError(f"leaf_states must be 'keep' or 'replay', got {self.leaf_states!r}")
        if not isinstance(self.spec_beam, BeamOptions):
            raise ValueError(f"spec_beam must be a BeamOptions, got {type(self.spec_beam).__name__}")
        if self.strategy == "spec_beam":
            if self.leaf_states != "keep":
                raise ValueError("spec_beam keeps every candidate's state in its batch: use leaf_states='keep'")
            if self.width % self.kept:
                raise ValueError(f"spec_beam expands each of the k={self.kept} kept trajectories into width/k "
                                 f"children: width ({self.width}) must be a multiple of k (set beam_width)")
        elif self.spec_beam != BeamOptions():
            raise ValueError(f"spec_beam options apply to strategy='spec_beam' only (got {self.strategy!r})")

    @property
    def kept(self):
        return self.beam_width or max(1, round(math.sqrt(self.width)))

