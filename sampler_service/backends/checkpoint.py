"""A model's Hugging Face checkpoint as the engines that load it by name see it: its
tensors (from the safetensors headers alone), the other names a trainer may give them,
and its end-of-sequence ids.

The in-process vLLM engine and the `vllm serve` servers driven over HTTP both read it;
neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sampler_service.weights.types import TensorSpec

#: The tensor a tied `lm_head.weight` shares.
EMBEDDING = "model.embed_tokens.weight"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The model's Hugging Face checkpoint: tensor order, specs and files."""

    order: list[str]  # canonical names in file order (the order vLLM loads best)
    specs: dict[str, TensorSpec]  # canonical name -> spec
    files: dict[str, str]  # canonical name -> safetensors file holding it
    aliases: dict[str, str | None]  # accepted other name -> canonical name (None: skip)

    def weight_specs(self) -> dict[str, TensorSpec]:
        """Every name an update may use: the canonical ones and their aliases (a tied
        lm_head.weight has the embedding's spec, and is skipped on load)."""
        specs = dict(self.specs)
        for alias, canonical in self.aliases.items():
            specs.setdefault(alias, self.specs[canonical or EMBEDDING])
        return specs

    def nccl_specs(self) -> tuple[dict[str, TensorSpec], set[str]]:
        """Tensors an NCCL round may send (checkpoint names only: they go to vLLM's loader
        unchanged) and those it must send (all but a tied lm_head)."""
        specs = dict(self.specs)
        if "lm_head.weight" in self.aliases:  # tied: vLLM's loader skips it
            specs["lm_head.weight"] = self.specs[EMBEDDING]
        return specs, set(self.specs)

    def canonical(self, names: list[str] | set[str] | frozenset[str]) -> set[str]:
        """The canonical tensors `names` update (a tied lm_head updates none)."""
        out = {self.aliases.get(n, n) for n in names}
        return {n for n in out if n is not None}

    @property
    def vocab_size(self) -> int | None:
        embedding = self.specs.get(EMBEDDING)
        return int(embedding.shape[0]) if embedding is not None else None


def read_checkpoint(model_dir: Path) -> Checkpoint:
    """Names, shapes and dtypes of every tensor in `model_dir/*.safetensors` (headers only).

    Also accepts the names a bare base-model `save_pretrained` writes (without the
    `model.` prefix), and `lm_head.weight` of a model with tied embeddings (which
    checkpoints omit and vLLM ignores).
    """
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no *.safetensors checkpoint files (the vLLM engines need one)"
        )
    order: list[str] = []
    specs: dict[str, TensorSpec] = {}
    where: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                meta = handle.get_slice(name)
                specs[name] = TensorSpec(shape=tuple(meta.get_shape()), dtype=meta.get_dtype())
                where[name] = str(file)
                order.append(name)
    aliases: dict[str, str | None] = {}
    for name in order:
        if name.startswith("model.") and name[len("model.") :] not in specs:
            aliases[name[len("model.") :]] = name
    config = read_json(model_dir / "config.json")
    tied = bool(config.get("tie_word_embeddings", False))
    if tied and "lm_head.weight" not in specs and EMBEDDING in specs:
        aliases["lm_head.weight"] = None
    return Checkpoint(order, specs, where, aliases)


def eos_token_ids(model_dir: Path) -> list[int]:
    """End-of-sequence ids from config.json and generation_config.json (as the hf backend)."""
    ids: list[int] = []
    for file in ("config.json", "generation_config.json"):
        value = read_json(model_dir / file).get("eos_token_id")
        for token in [value] if isinstance(value, int) else value or []:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is missing or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
