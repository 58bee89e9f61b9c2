"""stree.enable(model): make model.generate(input_ids, draft_model=draft, ...) run speculative tree decoding.

Without draft_model the call goes to HF's own generate unchanged. With it, the GenerationConfig merged as HF merges
it (the call's or the model's, unset fields from the model's, then HF's defaults, the call's keyword arguments over
all) must only use the options listed in HONOURED (or leave the others at HF's defaults); anything else raises
NotImplementedError rather than give a result that differs from HF's. Lengths follow HF too (_lengths).
"""
import copy

from transformers import GenerationConfig

from .decoding import DEFAULT_TREE, generate, is_batch
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
    """The GenerationConfig HF's generate would decode with: the call's config (else the model's), its unset fields
    taken from the model's, then from HF's defaults, then the call's keyword arguments over all of them."""
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    defaults = GenerationConfig._get_default_generation_params()
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**defaults, defaults_only=True)
    unused = config.update(**kwargs)
    if unused:
        raise TypeError(f"unexpected arguments for generate with draft_model: {sorted(unused)}")
    unsupported = {name: value for name, value in config.to_dict().items()
                   if name not in HONOURED and name not in NO_EFFECT and value is not None
                   and value != defaults.get(name)}
    if unsupported:
        raise NotImplementedError(f"stree's tree decoding does not implement {unsupported}; call generate without "
                                  f"draft_model to use HF's own decoding. It honours: {', '.join(HONOURED)}")
    return config


def _lengths(model, config, prompt_length, default_max_length):
    """(max_new_tokens, min_new_tokens) as HF's generate derives them from a merged config: max_new_tokens over
    max_length, and when no max_length was set anywhere (default_max_length) HF's default one counts new tokens
    (within max_position_embeddings); min_new_tokens over min_length. A prompt that already fills max_length is
    refused, as HF refuses it."""
    if config.max_new_tokens is not None:
        max_length = prompt_length + config.max_new_tokens
    elif default_max_length:
        max_length = prompt_length + config.max_length
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        max_length = max_length if limit is None else min(max_length, limit)
    else:
        max_length = config.max_length
    if prompt_length >= max_length:
        raise ValueError(f"the prompt has {prompt_length} tokens and max_length is {max_length}: nothing would be "
                         "generated; pass max_new_tokens >= 1 (or a larger max_length), as HF's generate asks")
    min_new = config.min_new_tokens if config.min_new_tokens is not None else max(config.min_length - prompt_length, 0)
    return max_length - prompt_length, min_new


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
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("with draft_model, input_ids must be a (batch, prompt_length) tensor")
        default_max_length = (kwargs.get("max_length") is None and model.generation_config.max_length is None
                              and (generation_config is None or generation_config.max_length is None))
        config = _effective_config(model, generation_config, kwargs)
        max_new, min_new = _lengths(model, config, input_ids.shape[1], default_max_length)
        sampling = dict(temperature=config.temperature, top_k=config.top_k or None,
                        top_p=config.top_p if config.top_p < 1.0 else None) if config.do_sample else {}
        batch = is_batch(input_ids, attention_mask)
        return generate(model, input_ids, draft_model=draft_model, max_new_tokens=max_new,
                        min_new_tokens=min_new, eos_token_id=config.eos_token_id, tree=tree, streamer=streamer,
                        stopping_criteria=stopping_criteria, compile=stree_compile,
                        attention_mask=attention_mask if batch else None, pad_token_id=config.pad_token_id,
                        **sampling)

    model.generate = tree_generate
    return model


def disable(model):
    """Undo enable(): model.generate is HF's again."""
    if "generate" in vars(model):
        del model.generate
    return model

