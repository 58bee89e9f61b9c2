"""The distillation trainer: AdamW, warmup + cosine, gradient accumulation, mixed precision on GPUs, progress bar,
periodic acceptance evaluation with the target, safetensors checkpoints (save_pretrained) and resume.

Runs as one process or under torch.distributed (torchrun / accelerate launch): the student is wrapped in DDP
and every process reads its share of each global batch through a DistributedSampler, so N processes with
batch_size b compute the same update as one process with batch_size N*b when every sequence counts the same
number of positions (with uneven masks each process averages over its own positions first).
"""
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ..checks import check_float, check_ids, check_int, vocab_size
from .losses import TopK, check_weights, mixture_loss


@dataclass
class TrainConfig:
    output_dir: str
    steps: int = 1000
    batch_size: int = 8                 # sequences per process per micro-batch
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    losses: dict = field(default_factory=lambda: {"forward_kl": 1.0})
    temperature: float = 1.0
    teacher_top_k: int = 0              # > 0: keep only the teacher's top-k logits per position
    mixed_precision: str = "auto"       # auto = bf16 autocast on CUDA, none on CPU; or "no", "bf16", "fp16"
    eval_every: int = 0                 # steps between acceptance evaluations (0 = never)
    eval_new_tokens: int = 32
    eval_tree: tuple = (3, 2, 2, 1)
    save_every: int = 0                 # steps between checkpoints (0 = only the final one)
    log_every: int = 10
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        """ValueError naming the first bad field."""
        for name, low in (("steps", 1), ("batch_size", 1), ("grad_accum", 1), ("warmup", 0), ("teacher_top_k", 0),
                          ("eval_every", 0), ("eval_new_tokens", 1), ("save_every", 0), ("log_every", 0)):
            check_int(name, getattr(self, name), low)
        for name, strict in (("lr", True), ("temperature", True), ("min_lr_ratio", False), ("weight_decay", False),
                             ("grad_clip", False)):
            check_float(name, getattr(self, name), 0.0, strict=strict)
        if self.min_lr_ratio > 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        check_weights(self.losses)
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be auto, no, bf16 or fp16, got {self.mixed_precision!r}")


def _distributed():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def lr_factor(step, warmup, total, min_ratio):
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Distils `teacher` (the target, frozen) into `student` on `dataset` (dicts of input_ids, labels, mask).

    teacher may be None when the losses are cross-entropy only (plain language-model training, e.g. of a target);
    otherwise it must share the student's vocabulary. eval_prompts: (n, P) int64 held-out prompts for the acceptance
    evaluation (needs a teacher). Token ids outside the student's vocabulary, in eval_prompts or in a batch of the
    dataset, raise ValueError (a batch's when it is drawn).
    """

    def __init__(self, student, config, dataset, teacher=None, eval_prompts=None):
        self.config, self.teacher, self.eval_prompts = config, teacher, eval_prompts
        self.vocab = vocab_size(student)
        needs_teacher = sorted(name for name in config.losses if name != "cross_entropy")
        if teacher is None and needs_teacher:
            raise ValueError(f"losses {needs_teacher} need a teacher (only cross_entropy trains without one)")
        if teacher is not None and vocab_size(teacher) != self.vocab:
            raise ValueError(f"the student's vocabulary ({self.vocab}) differs from the teacher's "
                             f"({vocab_size(teacher)}); they must share a tokenizer")
        if config.eval_every and (teacher is None or eval_prompts is None):
            raise ValueError(f"eval_every={config.eval_every} needs a teacher and eval_prompts")
        if eval_prompts is not None:
            if not isinstance(eval_prompts, torch.Tensor) or eval_prompts.dim() != 2 or 0 in eval_prompts.shape:
                raise ValueError("eval_prompts must be a non-empty (n, P) tensor of token ids")
            check_ids("eval_prompts", eval_prompts, self.vocab)
        if teacher is not None:
            teacher.eval().requires_grad_(False)
        self.rank, self.world = _distributed()
        self.student = student
        self.device = next(student.parameters()).device
        self.model = DistributedDataParallel(student) if self.world > 1 else student
        self.sampler = DistributedSampler(dataset, num_replicas=self.world, rank=self.rank, shuffle=True,
                                          seed=config.seed, drop_last=True)
        self.loader = DataLoader(dataset, batch_size=config.batch_size, sampler=self.sampler, drop_last=True)
        if len(self.loader) == 0:
            raise ValueError(f"the dataset ({len(dataset)} sequences) is smaller than one batch")
        trained = [p for p in student.parameters() if p.requires_grad]  # not a frozen teacher's shared ones
        decay = [p for p in trained if p.dim() >= 2]
        no_decay = [p for p in trained if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=config.weight_decay),
                                            dict(params=no_decay, weight_decay=0.0)], lr=config.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config.warmup, config.steps, config.min_lr_ratio))
        precision = config.mixed_precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "no"
        self.autocast_dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler(enabled=precision == "fp16")
        self.step = 0
        self.history = []

    def _batches(self):
        """Micro-batches forever, epoch after epoch, resuming where `self.step` says."""
        per_epoch = len(self.loader)
        consumed = self.step * self.config.grad_accum
        epoch, skip = divmod(consumed, per_epoch)
        while True:
            self.sampler.set_epoch(epoch)
            for i, batch in enumerate(self.loader):
                if i >= skip:
                    yield {k: v.to(self.device) for k, v in batch.items()}
            epoch, skip = epoch + 1, 0

    def _loss(self, batch):
        check_ids("a batch of the dataset", batch["input_ids"], self.vocab)
        teacher = None
        if self.teacher is not None and any(name != "cross_entropy" for name in self.config.losses):
            with torch.no_grad():
                teacher = self.teacher(input_ids=batch["input_ids"]).logits
            if self.config.teacher_top_k:
                teacher = TopK.of(teacher, self.config.teacher_top_k)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            logits = self.model(input_ids=batch["input_ids"]).logits
        return mixture_loss(self.config.losses, logits, teacher, batch["labels"], batch["mask"],
                            self.config.temperature)

    def train(self):
        """Run until config.steps; returns the history (one dict per logged step)."""
        from tqdm.auto import tqdm
        cfg = self.config
        self.model.train()
        batches = self._batches()
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress or self.rank != 0)
        tokens, start = 0, time.perf_counter()
        while self.step < cfg.steps:
            self.optimizer.zero_grad(set_to_none=True)
            parts_sum = {}
            for _ in range(cfg.grad_accum):
                batch = next(batches)
                loss, parts = self._loss(batch)
                self.scaler.scale(loss / cfg.grad_accum).backward()
                tokens += int(batch["mask"].sum()) * self.world
                for name, value in parts.items():
                    parts_sum[name] = parts_sum.get(name, 0.0) + value / cfg.grad_accum
            self.scaler.unscale_(self.optimizer)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.student.parameters(), cfg.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.step += 1
            rate = tokens / (time.perf_counter() - start)
            bar.update(1)
            bar.set_postfix(loss=f"{sum(parts_sum.values()):.4f}", tok_s=f"{rate:.0f}")
            record = dict(step=self.step, lr=self.scheduler.get_last_lr()[0], tokens_per_s=rate, **parts_sum)
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                record["tau"] = self.evaluate()
            if cfg.log_every and (self.step % cfg.log_every == 0 or "tau" in record or self.step == cfg.steps):
                self.history.append(record)
            if cfg.save_every and self.step % cfg.save_every == 0:
                self.save(os.path.join(cfg.output_dir, f"checkpoint-{self.step}"))
        bar.close()
        self.save(os.path.join(cfg.output_dir, "final"))
        return self.history

    @torch.no_grad()
    def evaluate(self):
        """Mean tau (tokens per target pass) of the student as draft on the held-out prompts (rank 0)."""
        if self.teacher is None or self.eval_prompts is None:
            raise ValueError("acceptance evaluation needs a teacher and eval_prompts")
        from stree.decoding import generate
        tau = 0.0
        if self.rank == 0:
            self.student.eval()
            passes = []
            for prompt in self.eval_prompts:
                _, stats = generate(self.teacher, prompt[None].to(self.device), draft_model=self.student,
                                    max_new_tokens=self.config.eval_new_tokens, tree=self.config.eval_tree,
                                    eos_token_id=[], return_stats=True)
                passes += stats.tokens_per_pass
            tau = sum(passes) / max(len(passes), 1)
            self.student.train()
        if self.world > 1:
            dist.barrier()
        return tau

    def save(self, path):
        """save_pretrained (safetensors) of the student plus trainer_state.pt for resume (rank 0 writes)."""
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            self.student.save_pretrained(path, safe_serialization=True)
            torch.save(dict(step=self.step, optimizer=self.optimizer.state_dict(),
                            scheduler=self.scheduler.state_dict(), scaler=self.scaler.state_dict(),
                            history=self.history, config=asdict(self.config)),
                       os.path.join(path, "trainer_state.pt"))
        if self.world > 1:
            dist.barrier()

    def _load_weights(self, path):
        from safetensors.torch import load_file
        weights = load_file(os.path.join(path, "model.safetensors"), device=str(self.device))
        missing, unexpected = self.student.load_state_dict(weights, strict=False)
        # Tied weights are stored once; anything else missing is an error.
        tied = set(getattr(self.student, "_tied_weights_keys", None) or [])
        if unexpected or set(missing) - tied:
            raise ValueError(f"checkpoint does not match the student: missing {missing}, unexpected {unexpected}")

    def resume(self, path):
        """Continue from a checkpoint folder written by save(): weights, optimizer, schedule and data position."""
        self._load_weights(path)
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.history = state["step"], state["history"]
        return self
