"""One generation at a time on a TreeModel. A TreeModel holds one sequence's state, and the compiled TreeModels stree
keeps per model (compile.compiled_tree_model) are shared by every generate() call on that model: a call claims its
TreeModels for its whole length. Another thread's call waits until they are released (so both are exact, one after
the other); the same thread's raises, since waiting would never end."""
import threading

_HOLDERS = threading.Condition()  # guards every TreeModel's _holder (the thread ident of the call holding it)


class Claim:
    """Holds `tree_models` (None entries are skipped) for one generation; release() is idempotent. All of them are
    taken at once, so that two calls claiming the same two models in opposite roles cannot deadlock."""

    def __init__(self, tree_models):
        self.tree_models = list({id(m): m for m in tree_models if m is not None}.values())
        me = threading.get_ident()
        with _HOLDERS:
            if any(m._holder == me for m in self.tree_models):
                raise RuntimeError("a generation in this thread still holds this model's stree engine (a streamer or "
                                   "stopping criterion calling generate on the same model, or an unfinished "
                                   "Generation): finish or close() that one first")
            _HOLDERS.wait_for(lambda: all(m._holder is None for m in self.tree_models))
            for m in self.tree_models:
                m._holder = me

    def release(self):
        with _HOLDERS:
            for m in self.tree_models:
                m._holder = None
            self.tree_models = []
            _HOLDERS.notify_all()
