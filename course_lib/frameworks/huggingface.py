"""A Hugging Face ``config.json`` (Llama, Mistral, Mixtral, Qwen2) as the course's ModelConfig.

These four families are the course model's: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP
(Mixtral: a mixture of SwiGLU experts; Qwen2: biases on q, k, v). Another ``model_type`` is refused by name: its
layers are not the course's, and counting them as if they were would be a guess. Fields that change nothing the
course counts (dropout, initializer range, token ids) are accepted; fields it does not model are named.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..model import PRESETS, ModelConfig, preset
from .common import ConfigError, nearest, whole

FAMILIES = ("llama", "mistral", "mixtral", "qwen2")
SHAPE = {"vocab_size": "vocab_size", "hidden_size": "hidden", "num_hidden_layers": "num_layers",
         "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
         "intermediate_size": "intermediate", "max_position_embeddings": "max_seq_len", "rope_theta": "rope_theta",
         "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings", "num_local_experts": "num_experts",
         "num_experts_per_tok": "top_k"}
NO_EFFECT = {"architectures", "model_type", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id",
             "pad_token_id", "hidden_act", "initializer_range", "use_cache", "attention_dropout", "pretraining_tp",
             "rope_scaling", "use_sliding_window", "max_window_layers", "output_router_logits", "router_aux_loss_coef",
             "router_jitter_noise", "mlp_bias", "_name_or_path", "head_dim", "attention_bias"}
# Read, and not counted as the framework runs it: named in the report.
NOT_MODELLED = {"sliding_window": "attention over a window of the last {value} tokens: the course times and "
                                  "counts full causal attention (the same below {value} tokens)"}


def load_model(model: str) -> tuple[ModelConfig, str, list[str], list[str]]:
    """``model``: a course preset's name, or a config.json's path. Returns (config, its name, what it does that
    the course does not model, unknown keys)."""
    if model in PRESETS:
        return preset(model), model, [], []
    path = Path(model)
    try:
        fields = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"--model {model}: neither a course preset ({', '.join(PRESETS)}) nor a readable "
                          f"config.json ({error.strerror or error})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{model}: not JSON ({error.msg}, line {error.lineno})") from None
    return from_fields(fields, str(path))


def from_fields(fields: dict, where: str) -> tuple[ModelConfig, str, list[str], list[str]]:
    """A config.json's fields as (ModelConfig, name, not modelled, unknown)."""
    if not isinstance(fields, dict):
        raise ConfigError(f"{where}: a config.json is a JSON object of fields")
    family = fields.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"{where}: model_type = {family!r} is not modelled: the course reads "
                          f"{', '.join(FAMILIES)} (RMSNorm, rotary positions, grouped-query attention, SwiGLU)")
    missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if key not in fields]
    if missing:
        raise ConfigError(f"{where}: no {', '.join(missing)}: a {family} config.json states its shape")
    shape = {name: fields[key] for key, name in SHAPE.items() if fields.get(key) is not None}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "num_key_value_heads", "max_position_embeddings", "num_local_experts", "num_experts_per_tok"):
        if fields.get(key) is not None:
            whole(f"{where}: {key}", fields[key])
    if "max_seq_len" not in shape:
        raise ConfigError(f"{where}: no max_position_embeddings: the course needs the model's longest sequence")
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    if fields.get("head_dim") not in (None, hidden // heads):
        raise ConfigError(f"{where}: head_dim = {fields['head_dim']} is not hidden_size / num_attention_heads = "
                          f"{hidden} / {heads}: the course model's heads split the width evenly")
    shape["attn_bias"] = family == "qwen2" or bool(fields.get("attention_bias"))
    try:
        config = ModelConfig(**shape)
    except (ValueError, TypeError) as error:     # a field of the wrong kind (a string for rope_theta)
        raise ConfigError(f"{where}: {error}") from None
    not_modelled = [f"{key} = {fields[key]}: " + reason.format(value=fields[key])
                    for key, reason in NOT_MODELLED.items() if fields.get(key)
                    and not (key == "sliding_window" and family == "qwen2" and not fields.get("use_sliding_window"))]
    unknown = [nearest(key, set(SHAPE) | NO_EFFECT | set(NOT_MODELLED)) for key in fields
               if key not in SHAPE and key not in NO_EFFECT and key not in NOT_MODELLED]
    return config, fields.get("_name_or_path") or f"{family} ({Path(where).name})", not_modelled, unknown
