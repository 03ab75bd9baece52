"""Recover the MOSS-RLHF release's models from their weight diffs and convert them to standard transformers classes.

The release stores, for every parameter whose name contains ``layers``, ``tuned − raw`` against the original
LLaMA-7B; every other tensor (embeddings, final norm, ``lm_head``, ``reward_head``) is stored whole. Recovery adds
the raw tensor back, tensor by tensor: diff and raw shards are memory-mapped (safetensors, or ``torch.load(mmap=True)``
for ``.bin``), so the peak memory is about one output shard (``max_shard_size``) plus the tensor at hand — never two
models. The result is written into a temporary sibling folder and renamed into place only after the published sum
check passed: a failed check leaves nothing at ``output``.

Conversion: reward → ``LlamaForSequenceClassification`` (``num_labels=1``, ``score.weight`` = ``reward_head.weight``,
``lm_head`` dropped, ``pad_token_id`` = ``<unk>`` = 0), whose score at the last non-pad token equals the release's
``reward_head(last_hidden_state)`` at the last position of a left-padded batch; sft/policy → ``LlamaForCausalLM``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

from ..checkpoint import atomic_directory
from .prompt import SPEAKER_TAGS, setup_tokenizer

logger = logging.getLogger(__name__)

ModelType = Literal["reward", "sft", "policy"]
#: The release's model types: the reward model, the SFT model and the PPO(-max) policy.
MODEL_TYPES = ("reward", "sft", "policy")
#: The release's languages.
LANGS = tuple(SPEAKER_TAGS)
# Sum of all recovered parameters in float32, as published with the release (relative tolerance 1e-5).
EXPECTED_SUMS = {("reward", "en"): 50810.703125, ("sft", "en"): 50874.84765625, ("reward", "zh"): 49954.0859375}
#: The published weight diffs, by ``(model_type, lang)``.
RELEASES = {
    ("reward", "en"): "fnlp/moss-rlhf-reward-model-7B-en",
    ("sft", "en"): "fnlp/moss-rlhf-sft-model-7B-en",
    ("policy", "en"): "fnlp/moss-rlhf-policy-model-7B-en",
    ("reward", "zh"): "Ablustrund/moss-rlhf-reward-model-7B-zh",
}
RELATIVE_TOLERANCE = 1e-5
#: The record :func:`recover` writes next to the weights (keys: model_type, lang, source_diff, source_raw,
#: expected_sum, recovered_sum, dtype, recovery_command); :mod:`trl_ppomax.moss.card` reads it.
CONVERSION_INFO = "trl_ppomax_conversion.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class IntegrityError(ValueError):
    """The recovered weights do not add up to the published sum."""


# --------------------------------------------------------------------------------------------------------------------
# Reading checkpoints tensor by tensor
# --------------------------------------------------------------------------------------------------------------------
class TensorFolder:
    """Lazy, memory-mapped access to the tensors of a Hugging Face checkpoint folder: safetensors or ``.bin``,
    sharded (with an ``*.index.json``) or single-file."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._open_file: str | None = None
        self._open: dict | object | None = None
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.folder / index_name
            if index.is_file():
                return json.loads(index.read_text())["weight_map"]
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (self.folder / single).is_file():
                return {name: single for name in self._names_in(single)}
        raise FileNotFoundError(
            f"No weights in {self.folder}: expected model.safetensors, pytorch_model.bin, or a sharded checkpoint "
            "with its *.index.json (Hugging Face format)."
        )

    def _names_in(self, file: str) -> list[str]:
        return list(self._load(file).keys())

    def _load(self, file: str):
        """The open file (one at a time, so at most one shard is mapped)."""
        if self._open_file != file:
            path = self.folder / file
            if not path.is_file():
                raise FileNotFoundError(f"Shard {path} named in the index is missing.")
            if file.endswith(".safetensors"):
                self._open = safe_open(str(path), framework="pt")
            else:
                self._open = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self._open_file = file
        return self._open

    def names(self) -> list[str]:
        """Tensor names, grouped by file so that each shard is opened once."""
        return sorted(self.weight_map, key=lambda name: (self.weight_map[name], name))

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._load(self.weight_map[name])
        return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]


def recovered_tensors(diff: TensorFolder, raw: TensorFolder) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tuned)`` for every tensor of the diff: ``diff + raw`` for names containing ``layers``, else ``diff``.

    The raw shards are visited in the diff's order; each raw tensor is read on demand (memory-mapped).
    """
    for name in diff.names():
        tensor = diff[name]
        if "layers" in name:
            if name not in raw:
                raise KeyError(f"{name} is a diff tensor but the raw LLaMA checkpoint has no tensor of that name.")
            base = raw[name]
            if base.shape != tensor.shape:
                raise ValueError(f"{name}: diff shape {tuple(tensor.shape)} ≠ raw shape {tuple(base.shape)}.")
            tensor = tensor.float() + base.float()
        yield name, tensor


def converted_name(name: str, model_type: ModelType) -> str | None:
    """The tensor's name in the standard class, or None when the standard class has no such tensor."""
    if model_type == "reward":
        if name.startswith("lm_head."):
            return None  # the score head replaces the unembedding
        return name.replace("reward_head.", "score.", 1) if name.startswith("reward_head.") else name
    return None if name.startswith("reward_head.") else name


# --------------------------------------------------------------------------------------------------------------------
# Writing shards as they fill
# --------------------------------------------------------------------------------------------------------------------
def shard_size_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a whole number and a unit as transformers reads them ("2GB", "500MB",
    "1GiB"; a lower-case "b" means bits)."""
    try:
        value = convert_file_size_to_int(size)
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(
            f'Invalid --max-shard-size {size!r}: give a whole number followed by a unit, e.g. "5GB", "500MB" '
            'or "2GiB".'
        ) from err
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f'Invalid --max-shard-size {size!r}: it must be positive, e.g. "5GB".')
    return value


@dataclass
class ShardWriter:
    """Buffers tensors and writes a safetensors shard whenever ``max_bytes`` would be exceeded; ``finish`` names the
    shards ``model-0000i-of-0000n.safetensors`` (or ``model.safetensors``) and writes the index."""

    folder: Path
    max_bytes: int

    def __post_init__(self) -> None:
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffered + size > self.max_bytes:
            self._flush()
        self.buffer[name] = tensor.contiguous()
        self.buffered += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.buffer, str(self.folder / f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.buffer))
        self.buffer, self.buffered = {}, 0

    def finish(self) -> None:
        if self.buffer:
            self._flush()
        count = len(self.shards)
        names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        weight_map = {}
        for i, (shard, final) in enumerate(zip(self.shards, names, strict=True)):
            os.replace(self.folder / f"shard-{i:05d}.tmp", self.folder / final)
            weight_map.update(dict.fromkeys(shard, final))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


# --------------------------------------------------------------------------------------------------------------------
# Recovery
# --------------------------------------------------------------------------------------------------------------------
def expected_sum_for(model_type: ModelType, lang: str, expected_sum: float | None, check: bool) -> float | None:
    """The sum to check against: the caller's, else the published one; None when the check is skipped."""
    if not check:
        return None
    if expected_sum is not None:
        return expected_sum
    if (model_type, lang) not in EXPECTED_SUMS:
        raise ValueError(
            f"No published checksum for the {lang} {model_type} model: pass expected_sum (--expected-sum) or skip the "
            "check explicitly (check=False / --skip-integrity-check)."
        )
    return EXPECTED_SUMS[(model_type, lang)]


def recover(
    raw: str | os.PathLike,
    diff: str | os.PathLike,
    output: str | os.PathLike,
    model_type: ModelType,
    lang: str = "en",
    expected_sum: float | None = None,
    check: bool = True,
    dtype: str = "float32",
    max_shard_size: int | str = "2GB",
    progress: bool = True,
) -> Path:
    """Recover ``diff`` (a release folder) against ``raw`` (LLaMA-7B, Hugging Face format) and write a standard
    transformers checkpoint, tokenizer with the MOSS chat template and a conversion record to ``output``.

    Raises ``IntegrityError`` (and writes nothing) when the parameters do not sum to the published value, and
    ``ValueError`` for an unknown ``model_type``, ``lang`` or ``dtype`` or an invalid ``max_shard_size``.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}.")
    if lang not in LANGS:
        raise ValueError(f"lang must be one of {LANGS}, got {lang!r}.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    target = expected_sum_for(model_type, lang, expected_sum, check)
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty; choose another output folder or remove it.")
    max_bytes = shard_size_bytes(max_shard_size)
    diff_folder, raw_folder = TensorFolder(diff), TensorFolder(raw)
    with atomic_directory(output) as folder:  # nothing at ``output`` unless every step below succeeds
        temporary = Path(folder)
        total = _write_tensors(diff_folder, raw_folder, temporary, model_type, DTYPES[dtype], max_bytes, progress)
        if target is not None and not math.isclose(total, target, rel_tol=RELATIVE_TOLERANCE):
            raise IntegrityError(
                f"The recovered {lang} {model_type} weights sum to {total:.6f}, not the published {target:.6f} "
                f"(relative tolerance {RELATIVE_TOLERANCE:g}). The raw LLaMA-7B weights or the diff are not the ones "
                "the release was made from, or a file is corrupted. Nothing was written."
            )
        _write_config_and_tokenizer(Path(diff), Path(raw), temporary, model_type, lang, dtype)
        info = {
            "model_type": model_type,
            "lang": lang,
            "source_diff": str(diff),
            "source_raw": str(raw),
            "expected_sum": target,
            "recovered_sum": total,
            "dtype": dtype,
            "recovery_command": recovery_command(raw, diff, output, model_type, lang, dtype),
        }
        (temporary / CONVERSION_INFO).write_text(json.dumps(info, indent=2))
    return output


def _write_tensors(diff, raw, folder, model_type, dtype, max_bytes, progress) -> float:
    """Stream recovered tensors into shards; returns the float32 sum of every recovered parameter."""
    from tqdm.auto import tqdm

    writer = ShardWriter(folder, max_bytes)
    total = 0.0
    names = diff.names()
    for name, tensor in tqdm(recovered_tensors(diff, raw), total=len(names), desc="Recovering", disable=not progress):
        total += tensor.float().sum().item()  # float32, as the release computed it
        new_name = converted_name(name, model_type)
        if new_name is not None:
            writer.add(new_name, tensor.to(dtype))
    writer.finish()
    return total


def _write_config_and_tokenizer(diff: Path, raw: Path, folder: Path, model_type, lang, dtype) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(diff if (diff / "config.json").is_file() else raw)
    config.pad_token_id = 0  # <unk>, as in the release
    config.dtype = dtype
    if model_type == "reward":
        config.architectures = ["LlamaForSequenceClassification"]
        config.num_labels = 1
    else:
        config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    source = diff if any(diff.glob("tokenizer*")) else raw
    tokenizer = setup_tokenizer(AutoTokenizer.from_pretrained(source), lang=lang)
    tokenizer.save_pretrained(folder)


def recovery_command(raw, diff, output, model_type, lang, dtype=None) -> str:
    """The ``trl-ppomax moss recover`` command line (shell-quoted) that writes ``output``; no ``--dtype`` if None."""
    parts = ["trl-ppomax", "moss", "recover", "--raw", raw, "--diff", diff, "--output", output]
    parts += ["--model-type", model_type, "--lang", lang] + (["--dtype", dtype] if dtype else [])
    return " ".join(shlex.quote(str(part)) for part in parts)


def resolve_source(path_or_repo: str) -> str:
    """A local folder as is; otherwise a Hub repo id, downloaded (weights, config, tokenizer) with huggingface_hub."""
    if os.path.isdir(path_or_repo):
        return path_or_repo
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "tokenizer*"]
    return snapshot_download(path_or_repo, allow_patterns=patterns)
