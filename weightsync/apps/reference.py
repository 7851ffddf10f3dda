"""Greedy reference continuations from an unsharded float32 copy of a trainer's weights.

Tests and the demo compare what an engine generates after a sync with what the trainer's own
weights generate, computed here in float32 on the CPU with transformers.
"""

from __future__ import annotations

from typing import Any

import torch


def _reference_model(model_path: str, state: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """(the float32 transformers model of the checkpoint's architecture holding `state`, its
    config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    # Built on the CPU, not on "meta": non-persistent buffers (a rope model's inv_freq) are
    # computed at construction and are not in `state`.
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.float().cpu() for k, v in state.items()}
    if set(state) - set(reference.state_dict()):
        # Checkpoint names (a MoE's experts one by one): loaded as transformers loads any
        # checkpoint, which converts them to the model's layout (the experts grouped again).
        reference, missing = _from_checkpoint_state(model_path, state)
    else:
        missing, _ = reference.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied:
        raise ValueError(
            f"the trainer's state lacks {sorted(set(missing) - tied)[:5]} of the "
            f"architecture at {model_path}"
        )
    reference.tie_weights()
    reference.eval()
    return reference, config


def reference_generate(
    model_path: str,
    state: dict[str, torch.Tensor],
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
) -> dict[str, Any]:
    """{"tokens": [[ids]], "logprobs": [[float]]}: greedy continuations of `prompts` by the
    architecture of the checkpoint at `model_path` holding the weights `state` (HF names)."""
    reference, config = _reference_model(model_path, state)
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=config.pad_token_id,
            )
            new = out.sequences[0, len(prompt) :].tolist()
            tokens.append(new)
            logprobs.append(
                [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new)]
            )
    return {"tokens": tokens, "logprobs": logprobs}


def _from_checkpoint_state(model_path: str, state: dict[str, torch.Tensor]) -> tuple[Any, list]:
    """`state` written as a safetensors checkpoint beside the config of `model_path`, loaded
    back with `from_pretrained` in float32: (the model, the names it found no weight for)."""
    import shutil
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="weightsync-reference-") as tmp:
        save_file(
            {name: t.contiguous() for name, t in state.items()},
            str(Path(tmp) / "model.safetensors"),
        )
        shutil.copy(Path(model_path) / "config.json", Path(tmp) / "config.json")
        try:
            # (model, info): transformers' types leave out what output_loading_info returns
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, output_loading_info=True
            )
        except RuntimeError as exc:  # transformers' conversion found pieces that do not fit
            raise ValueError(
                f"the trainer's state does not load as a checkpoint of the "
                f"architecture at {model_path}: {str(exc).splitlines()[0]}"
            ) from exc
        model, info = loaded
        return model, list(info["missing_keys"])


def reference_margins(
    model_path: str, state: dict[str, torch.Tensor], sequences: list[list[int]], starts: list[int]
) -> list[list[float]]:
    """For each sequence, at each position from its start on: how far (in nats) the log-prob of
    the token there falls below the most likely token given the tokens before it, by the same
    model as `reference_generate` (0.0: the greedy choice)."""
    reference, _ = _reference_model(model_path, state)
    out = []
    with torch.no_grad():
        for sequence, start in zip(sequences, starts):
            logits = reference(torch.tensor([sequence])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            out.append(
                [
                    float(logp[i - 1].max() - logp[i - 1, sequence[i]])
                    for i in range(start, len(sequence))
                ]
            )
    return out
