"""Recover the MOSS-RLHF release's models from their weight diffs and convert them to standard transformers classes.

The release stores ``tuned − raw`` (against LLaMA-7B) for every parameter whose name contains ``layers``, and every
other tensor (embeddings, final norm, ``lm_head``, ``reward_head``) whole. Recovery adds the raw tensor back, tensor by
tensor, from memory-mapped shards (safetensors, or ``torch.load(mmap=True)`` for ``.bin``): the peak memory is about
one output shard (``max_shard_size``) plus the tensor at hand, never two models. The result is renamed into place only
after the published sum check passed: a failed check leaves nothing at ``output``.

transformers 4.30.2 (the release's) saved ``model.layers.N.self_attn.rotary_emb.inv_freq``, non-persistent from 4.31:
the diffs may hold it and the published sums count it, while a LLaMA-7B converted with a newer transformers may not (or
the reverse). Such buffers (:data:`NON_PERSISTENT_BUFFERS`) are never written; the sum check counts them as the release
did. Any other missing key, or a ``model_type`` that contradicts the diff's head, is an error raised before anything is
written.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

from trl_ppomax.data.files import atomic_directory
from trl_ppomax.moss.prompt import SPEAKER_TAGS, setup_tokenizer

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
#: expected_sum (published or given), recovered_sum (of the recovered weights, buffers excluded), buffers_sum,
#: sum_counts_buffers, dtype, recovery_command); :mod:`trl_ppomax.moss.card` reads it.
CONVERSION_INFO = "trl_ppomax_conversion.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Name endings of the buffers transformers 4.30.2 saved and newer ones do not: never written (:func:`buffers_sum`).
NON_PERSISTENT_BUFFERS = ("rotary_emb.inv_freq",)
#: Whether the published sums (:data:`EXPECTED_SUMS`) count the :data:`NON_PERSISTENT_BUFFERS`: they were computed on
#: transformers 4.30.2 state dicts (MOSS-RLHF issue #33: a zh sum short by exactly the inv_freq sum).
PUBLISHED_SUMS_COUNT_BUFFERS = True


class IntegrityError(ValueError):
    """The recovered weights do not add up to the published sum."""


# -- Reading checkpoints tensor by tensor ----------------------------------------------------------------------------
def load_bin_shard(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.bin`` checkpoint file, memory-mapped (an old non-zip file is read whole); a truncated or
    corrupt file raises ``ValueError`` naming it, not torch's "[Errno 22] Invalid argument"."""
    try:
        with open(path, "rb") as file:
            is_zip = file.read(4) == b"PK\x03\x04"  # torch.save's format since 1.6; mmap needs it
        return torch.load(path, map_location="cpu", mmap=is_zip, weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as error:  # torch raises OSError, RuntimeError, EOFError, IndexError, UnpicklingError…
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"
        raise ValueError(
            f"Shard {path} ({path.stat().st_size:,} bytes) is truncated or corrupt: torch cannot read it ({reason}). "
            "Re-download it (compare its size with the source's), then run the command again."
        ) from error


class TensorFolder:
    """Lazy, memory-mapped access to the tensors of a Hugging Face checkpoint folder: safetensors or ``.bin``,
    sharded (with an ``*.index.json``) or single-file."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._open_file: str | None = None
        self._open: dict | object | None = None
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        for index in (self.folder / "model.safetensors.index.json", self.folder / "pytorch_model.bin.index.json"):
            if index.is_file():
                return json.loads(index.read_text())["weight_map"]
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (self.folder / single).is_file():
                return dict.fromkeys(self._load(single).keys(), single)
        raise FileNotFoundError(
            f"No weights in {self.folder}: expected model.safetensors, pytorch_model.bin, or a sharded checkpoint "
            "with its *.index.json (Hugging Face format)."
        )

    def _load(self, file: str):
        """The open file (one at a time, so at most one shard is mapped)."""
        if self._open_file != file:
            path = self.folder / file
            if not path.is_file():
                raise FileNotFoundError(f"Shard {path} named in the index is missing.")
            self._open = (
                safe_open(str(path), framework="pt") if file.endswith(".safetensors") else load_bin_shard(path)
            )
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


def is_non_persistent_buffer(name: str) -> bool:
    """Whether ``name`` is a buffer that newer transformers no longer save (:data:`NON_PERSISTENT_BUFFERS`)."""
    return name.endswith(NON_PERSISTENT_BUFFERS)


def check_keys(diff: TensorFolder, raw: TensorFolder) -> None:
    """Raise ``ValueError`` naming the first missing key unless every diffed (``layers``) tensor is in the raw
    checkpoint and every raw tensor in the diff. :data:`NON_PERSISTENT_BUFFERS` are exempt, and logged as skipped."""
    for name in diff.names():
        if "layers" in name and not is_non_persistent_buffer(name) and name not in raw:
            raise ValueError(
                f"{name} is a diff tensor (tuned − raw) but the raw LLaMA checkpoint {raw.folder} has no tensor of "
                "that name: the raw weights are not the model the diff was made from."
            )
    for name in raw.names():
        if not is_non_persistent_buffer(name) and name not in diff:
            raise ValueError(
                f"The raw LLaMA checkpoint has {name} but the diff {diff.folder} does not: the recovered model would "
                "lack it. The diff is incomplete or was made from another model."
            )
    message = "Skipping %d non-persistent buffers of the %s checkpoint (%s, e.g. %s): not weights of a current model."
    for where, folder in (("diff", diff), ("raw", raw)):
        if names := _buffers(folder):
            logger.info(message, len(names), where, ", ".join(NON_PERSISTENT_BUFFERS), names[0])


def check_model_type(diff: TensorFolder, model_type: ModelType) -> None:
    """Raise ``ValueError`` when ``model_type`` contradicts the diff's head: a reward diff has ``reward_head.*`` (or an
    already-converted ``score.*``), an sft/policy diff has ``lm_head.*`` and no reward head."""
    reward = next((n for n in diff.names() if n.startswith(("reward_head.", "score."))), None)
    lm_head = next((n for n in diff.names() if n.startswith("lm_head.")), None)
    if model_type == "reward" and reward is None and lm_head is not None:
        raise ValueError(
            f"--model-type reward, but the diff {diff.folder} has {lm_head} and no reward_head (nor score) tensor, so "
            "it is an sft or policy model: pass --model-type sft or --model-type policy."
        )
    if model_type != "reward" and reward is not None:
        raise ValueError(
            f"--model-type {model_type}, but the diff {diff.folder} has {reward}, so it is a reward model: pass "
            "--model-type reward."
        )
    if reward is None and lm_head is None:
        raise ValueError(
            f"--model-type {model_type}, but the diff {diff.folder} has neither a reward_head nor an lm_head tensor: "
            "it is not a MOSS-RLHF model diff."
        )


def inv_freq(config) -> torch.Tensor:
    """One layer's rotary ``inv_freq`` as transformers 4.30.2 computed it (float32):
    ``1 / base^(arange(0, d, 2) / d)``, ``d`` = head dim, ``base`` = ``rope_theta`` (default 10000)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    base = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))


def buffers_sum(diff: TensorFolder, raw: TensorFolder, config) -> tuple[float, str]:
    """The float32 sum of the recovered :data:`NON_PERSISTENT_BUFFERS` as the release's state dict held them, and
    where it came from: each buffer is ``raw + diff``, the raw part from :func:`inv_freq` when only the diff has it;
    with no buffer in either checkpoint, ``num_hidden_layers`` × the sum of :func:`inv_freq`."""
    names = sorted(set(_buffers(diff)) | set(_buffers(raw)))
    if not names:
        return config.num_hidden_layers * inv_freq(config).sum().item(), "the config"
    total = 0.0
    for name in names:
        value = raw[name].float() if name in raw else inv_freq(config)
        if name in diff:
            value = value + diff[name].float()
        total += value.sum().item()
    return total, "the raw checkpoint" if all(name in raw for name in names) else "the checkpoints and the config"


def _buffers(folder: TensorFolder) -> list[str]:
    return [name for name in folder.names() if is_non_persistent_buffer(name)]


def recovered_tensors(diff: TensorFolder, raw: TensorFolder) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tuned)`` for every tensor of the diff but the :data:`NON_PERSISTENT_BUFFERS`: ``diff + raw`` for names
    containing ``layers``, else ``diff``; each raw tensor is read on demand (memory-mapped), in the diff's order."""
    for name in (name for name in diff.names() if not is_non_persistent_buffer(name)):
        tensor = diff[name]
        if "layers" in name:
            if name not in raw:
                raise ValueError(f"{name} is a diff tensor but the raw LLaMA checkpoint has no tensor of that name.")
            base = raw[name]
            if base.shape != tensor.shape:
                raise ValueError(f"{name}: diff shape {tuple(tensor.shape)} ≠ raw shape {tuple(base.shape)}.")
            tensor = tensor.float() + base.float()
        yield name, tensor


def converted_name(name: str, model_type: ModelType) -> str | None:
    """The tensor's name in the standard class, or None when the standard class has no such tensor."""
    if name.startswith("reward_head."):
        return name.replace("reward_head.", "score.", 1) if model_type == "reward" else None
    return None if model_type == "reward" and name.startswith("lm_head.") else name  # score replaces the unembedding


# -- Writing shards as they fill -------------------------------------------------------------------------------------
def shard_size_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a whole number and a unit as transformers reads them ("2GB", "500MB",
    "1GiB"; a lower-case "b" means bits)."""
    try:
        value = convert_file_size_to_int(size)
    except (ValueError, TypeError, AttributeError) as err:
        message = f'Invalid --max-shard-size {size!r}: give a whole number and a unit, e.g. "5GB", "500MB" or "2GiB".'
        raise ValueError(message) from err
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f'Invalid --max-shard-size {size!r}: it must be positive, e.g. "5GB".')
    return value


@dataclass
class ShardWriter:
    """Buffers tensors and writes a safetensors shard whenever ``max_bytes`` would be exceeded; ``finish`` names the
    shards ``model-0000i-of-0000n.safetensors`` (or ``model.safetensors``) and writes the index."""

    folder: Path
    max_bytes: int
    buffer: dict[str, torch.Tensor] = field(default_factory=dict, init=False)
    buffered: int = field(default=0, init=False)
    shards: list[list[str]] = field(default_factory=list, init=False)
    total_bytes: int = field(default=0, init=False)

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
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for i, (shard, final) in enumerate(zip(self.shards, names, strict=True)):
            os.replace(self.folder / f"shard-{i:05d}.tmp", self.folder / final)
            weight_map.update(dict.fromkeys(shard, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


# -- Recovery --------------------------------------------------------------------------------------------------------
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


def _check_choices(**given: tuple) -> None:
    """A ``ValueError`` for the first ``name=(value, allowed)`` whose value is not allowed."""
    for name, (value, allowed) in given.items():
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")


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

    The float32 sum of the recovered tensors is checked against the published one, which counts the rotary
    ``inv_freq`` buffers (:func:`buffers_sum`); a given ``expected_sum`` may count them or not (the two differ by far
    more than the tolerance). Raises ``IntegrityError`` (writing nothing) when the sum is off, and ``ValueError``
    (before writing anything) for an unknown ``model_type``, ``lang`` or ``dtype``, an invalid ``max_shard_size``, a
    ``model_type`` that contradicts the diff's head, or a tensor missing from the diff or the raw checkpoint.
    """
    from transformers import AutoConfig

    _check_choices(model_type=(model_type, MODEL_TYPES), lang=(lang, LANGS), dtype=(dtype, sorted(DTYPES)))
    target = expected_sum_for(model_type, lang, expected_sum, check)
    # Whether the target counts the non-persistent buffers: the published sums do; a given one may (None: either).
    counts_buffers = PUBLISHED_SUMS_COUNT_BUFFERS if target is not None and expected_sum is None else None
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty; choose another output folder or remove it.")
    max_bytes = shard_size_bytes(max_shard_size)
    diff_folder, raw_folder = TensorFolder(diff), TensorFolder(raw)
    check_keys(diff_folder, raw_folder)
    check_model_type(diff_folder, model_type)
    config = AutoConfig.from_pretrained(diff if (Path(diff) / "config.json").is_file() else raw)
    buffers, source = buffers_sum(diff_folder, raw_folder, config) if target is not None else (None, None)
    if counts_buffers:
        message = (
            "The published sum %.6f counts the rotary inv_freq buffers (transformers 4.30.2), which sum to %.6f "
            "(from %s) and are not written: the recovered weights must sum to %.6f."
        )
        logger.info(message, target, buffers, source, target - buffers)
    with atomic_directory(output) as folder:  # nothing at ``output`` unless every step below succeeds
        temporary = Path(folder)
        total = _write_tensors(diff_folder, raw_folder, temporary, model_type, DTYPES[dtype], max_bytes, progress)
        what = f"{lang} {model_type}"
        counted = None if target is None else check_sum(total, buffers, source, target, counts_buffers, what)
        _write_config_and_tokenizer(config, Path(diff), Path(raw), temporary, model_type, lang, dtype)
        info = dict(model_type=model_type, lang=lang, source_diff=str(diff), source_raw=str(raw), expected_sum=target)
        info.update(recovered_sum=total, buffers_sum=buffers, sum_counts_buffers=counted, dtype=dtype)
        info["recovery_command"] = recovery_command(raw, diff, output, model_type, lang, dtype)
        (temporary / CONVERSION_INFO).write_text(json.dumps(info, indent=2))
    return output


def check_sum(
    total: float, buffers: float, source: str, target: float, counts_buffers: bool | None, what: str
) -> bool:
    """Check ``total`` (the recovered weights' sum) against ``target`` (:data:`RELATIVE_TOLERANCE`), adding the
    buffers' sum ``buffers`` (from ``source``) if the target counts them, either way if ``counts_buffers`` is None.
    Returns whether they were counted; raises ``IntegrityError``."""
    for counted in (False, True) if counts_buffers is None else (counts_buffers,):
        if math.isclose(total + (buffers if counted else 0.0), target, rel_tol=RELATIVE_TOLERANCE):
            if counts_buffers is None:
                message = "The expected sum %.6f matches the recovered weights %s the rotary inv_freq buffers (%.6f)."
                logger.info(message, target, "plus" if counted else "without", buffers)
            return counted
    which = "the published sum (which counts the buffers)" if counts_buffers else "the expected sum"
    raise IntegrityError(
        f"The recovered {what} weights sum to {total:.6f}, {total + buffers:.6f} with the rotary inv_freq buffers "
        f"({buffers:.6f}, from {source}); {which} is {target:.6f} (relative tolerance {RELATIVE_TOLERANCE:g}). The "
        "raw LLaMA-7B weights or the diff are not the ones the release was made from, or a file is corrupted. "
        "Nothing was written."
    )


def _write_tensors(diff, raw, folder, model_type, dtype, max_bytes, progress) -> float:
    """Stream recovered tensors into shards; returns the float32 sum of the recovered parameters (buffers excluded)."""
    from tqdm.auto import tqdm

    writer = ShardWriter(folder, max_bytes)
    total = 0.0
    count = sum(not is_non_persistent_buffer(name) for name in diff.names())
    for name, tensor in tqdm(recovered_tensors(diff, raw), total=count, desc="Recovering", disable=not progress):
        total += tensor.float().sum().item()  # float32, as the release computed it
        if (new_name := converted_name(name, model_type)) is not None:
            writer.add(new_name, tensor.to(dtype))
    writer.finish()
    return total


def _write_config_and_tokenizer(config, diff: Path, raw: Path, folder: Path, model_type, lang, dtype) -> None:
    from transformers import AutoTokenizer

    config.pad_token_id = 0  # <unk>, as in the release
    config.dtype = dtype
    config.architectures = ["LlamaForSequenceClassification" if model_type == "reward" else "LlamaForCausalLM"]
    if model_type == "reward":
        config.num_labels = 1
    config.save_pretrained(folder)
    source = diff if any(diff.glob("tokenizer*")) else raw
    tokenizer = setup_tokenizer(AutoTokenizer.from_pretrained(source, legacy=True), lang=lang)  # the release's ids
    tokenizer.save_pretrained(folder)


def recovery_command(raw, diff, output, model_type, lang, dtype=None) -> str:
    """The ``trl-ppomax moss recover`` command line (shell-quoted) that writes ``output``; no ``--dtype`` if None."""
    parts = ["trl-ppomax", "moss", "recover", "--raw", raw, "--diff", diff, "--output", output]
    parts += ["--model-type", model_type, "--lang", lang] + (["--dtype", dtype] if dtype else [])
    return " ".join(shlex.quote(str(part)) for part in parts)


def resolve_source(path_or_repo: str, setting: str = "source") -> str:
    """A local folder as is, else a Hub repo id, downloaded (weights, config, tokenizer). A local-looking path that is
    no folder raises ``FileNotFoundError`` naming ``setting``, not a Hub error about a malformed repo id."""
    from trl_ppomax.data.sources import looks_local

    if os.path.isdir(path_or_repo):
        return path_or_repo
    if os.path.exists(path_or_repo):
        raise FileNotFoundError(f"{setting} {path_or_repo}: is a file, not a folder; pass the model's folder.")
    if looks_local(path_or_repo):
        raise FileNotFoundError(
            f"{setting} {path_or_repo}: the local folder {os.path.abspath(os.path.expanduser(path_or_repo))} does not "
            "exist. Fix the path; a Hub repository is named 'org/name'."
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "tokenizer*"]
    return snapshot_download(path_or_repo, allow_patterns=patterns)
