"""Moved: strategy "spec_beam" lives in stree.search.strategies.spec_beam. Re-exported here so that old imports
keep working."""
from .strategies.spec_beam import (MAX_SCORE, PERFECT_TIES, BeamOptions, BeamRun, Level, run_together,  # noqa: F401
                                   spec_beam_searches)
