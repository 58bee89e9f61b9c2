"""stree.enable(model): make model.generate(input_ids, draft_model=draft, ...) run speculative tree decoding.

Without draft_model the call goes to HF's own generate unchanged. With it, the merged GenerationConfig (the model's,
updated by the call's keyword arguments, HF defaults for what neither sets) must only use the options listed in
HONOURED (or leave the others at HF's defaults); anything else raises NotImplementedError rather than give a result
that differs from HF's.
"""
import copy

from transformers import GenerationConfig

from .decoding import DEFAULT_TREE, generate
from .models import TreeModel

HONOURED = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k",
            "top_p", "eos_token_id", "pad_token_id", "bos_token_id", "use_cache")
# Fields that change how HF runs, not what it returns for one unpadded row (or that only concern its assistants).
NO_EFFECT = ("transformers_version", "_from_model_config", "cache_implementation", "cache_config", "max_cache_len",
             "compile_config", "disable_compile", "prefill_chunk_size", "low_memory", "continuous_batching_config",
             "decoder_start_token_id", "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule",
             "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "output_attentions",
             "output_hidden_states")


def _effective_config(model, generation_config, kwargs):
    config = copy.deepcopy(generation_config or model.generation_config)
    unused = config.update(**kwargs)
    if unused:
        raise TypeError(f"unexpected arguments for generate with draft_model: {sorted(unused)}")
    defaults = GenerationConfig._get_default_generation_params()
    for name, value in defaults.items():
        if getattr(config, name, None) is None:
            setattr(config, name, value)
    unsupported = {name: value for name, value in config.to_dict().items()
                   if name not in HONOURED and name not in NO_EFFECT and value is not None
                   and value != defaults.get(name)}
    if unsupported:
        raise NotImplementedError(f"stree's tree decoding does not implement {unsupported}; call generate without "
                                  f"draft_model to use HF's own decoding. It honours: {', '.join(HONOURED)}")
    return config


def enable(model, *, tree=DEFAULT_TREE, compile=False):
    """Patch `model.generate` (this instance only) so that a draft_model= argument selects tree decoding.

    tree: the default draft tree (a branching tuple, StaticTree, DynamicTree or BeamTree); a call may pass tree=.
    compile: run the passes through torch.compile (stree.generate's compile=); a call may pass stree_compile=.
    Returns the model. stree.disable(model) restores HF's generate.
    """
    TreeModel(model)  # fails now, with the list of supported families, rather than at the first call
    hf_generate = model.generate

    def tree_generate(inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None, *,
                      draft_model=None, streamer=None, attention_mask=None, tree=tree, stree_compile=compile,
                      **kwargs):
        if draft_model is None:
            return hf_generate(inputs, generation_config, logits_processor, stopping_criteria, streamer=streamer,
                               attention_mask=attention_mask, **kwargs)
        input_ids = kwargs.pop("input_ids", inputs)
        if logits_processor:
            raise NotImplementedError("custom logits_processor is not supported with draft_model")
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("with draft_model, input_ids must be one unpadded row of shape (1, prompt_length)")
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise ValueError("with draft_model, only an all-ones attention_mask (one unpadded row) is supported")
        config = _effective_config(model, generation_config, kwargs)
        prompt_length = input_ids.shape[1]
        max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_length
        min_new = max(config.min_new_tokens or 0, config.min_length - prompt_length)
        sampling = dict(temperature=config.temperature, top_k=config.top_k or None,
                        top_p=config.top_p if config.top_p < 1.0 else None) if config.do_sample else {}
        return generate(model, input_ids, draft_model=draft_model, max_new_tokens=max(max_new, 0),
                        min_new_tokens=min_new, eos_token_id=config.eos_token_id, tree=tree, streamer=streamer,
                        stopping_criteria=stopping_criteria, compile=stree_compile, **sampling)

    model.generate = tree_generate
    return model


def disable(model):
    """Undo enable(): model.generate is HF's again."""
    if "generate" in vars(model):
        del model.generate
    return model

