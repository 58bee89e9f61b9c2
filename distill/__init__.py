"""Draft-model distillation (installed as ``stree.distill``). Not built yet: see the distillation issue."""
