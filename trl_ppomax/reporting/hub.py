"""Model cards, Hub metadata and pushing a model folder (``trl-ppomax push``).

Every card is drawn by :func:`render_card`: :func:`create_model_card` for the trainers, :func:`model_card` for a
model folder, :mod:`trl_ppomax.moss.card` for converted MOSS-RLHF models. :func:`push_folder` uploads a folder and its
card in one commit. Nothing here is specific to MOSS-RLHF.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id

from trl_ppomax.data.files import read_json

logger = logging.getLogger(__name__)

PAPER_TITLE = "Secrets of RLHF in Large Language Models Part I: PPO"
PAPER_ID = "2307.04964"
CITATION = """\
@article{zheng2023secrets,
    title        = {{Secrets of RLHF in Large Language Models Part I: PPO}},
    author       = {Rui Zheng and Shihan Dou and Songyang Gao and others},
    year         = 2023,
    journal      = {arXiv preprint arXiv:2307.04964}
}"""
#: The tags of every card trl-ppomax writes (trainer cards, pushed folders); other tag lists are built from it.
TAGS = ["trl", "trl-ppomax", "ppo", "ppo-max", "rlhf"]


#: The settings a trainer's card lists: the preset, the tricks of the paper's §5 and the reward model's
#: imitation-loss coefficient (β_rm, eq. 2).
CARD_SETTINGS = (
    "preset",
    "reward_norm",
    "reward_clip",
    "whiten_advantages",
    "advantage_clip",
    "kl_coef",
    "kl_estimator",
    "critic_warmup_steps",
    "max_grad_norm",
    "ptx_coef",
    "entropy_coef",
    "temperature",
    "top_p",
    "repetition_penalty",
    "learning_rate",
    "total_episodes",
    "num_ppo_epochs",
    "advantage_estimator",
    "lm_loss_coef",
)


def tracker_urls() -> dict[str, str]:
    """The URLs of the active tracker runs (wandb run, trackio Space), read only from modules already imported."""
    urls = {}
    url = getattr(getattr(sys.modules.get("wandb"), "run", None), "url", None)
    if isinstance(url, str):
        urls["Weights & Biases"] = url
    if "trackio" in sys.modules:
        with contextlib.suppress(Exception):  # an older or stub trackio: no URL
            from trl.trainer.utils import get_trackio_space_url

            if isinstance(url := get_trackio_space_url(), str):
                urls["Trackio"] = url
    return urls


def training_sections(args, log_history=None, urls: dict[str, str] | None = None) -> str:
    """Markdown for a trainer's card: the PPO-max settings, the ``eval_*`` numbers of the last ``log_history`` entry
    that has any, and the tracker URLs."""
    parts = []
    rows = [(name, getattr(args, name)) for name in CARD_SETTINGS if hasattr(args, name)]
    if rows:
        table = "\n".join(f"| `{name}` | `{value!r}` |" for name, value in rows)
        parts.append(f"## PPO-max settings\n\n| setting | value |\n|---|---|\n{table}")
    for entry in reversed(list(log_history or [])):
        evals = {k: v for k, v in entry.items() if k.startswith("eval_") and isinstance(v, (int, float))}
        if evals:
            table = "\n".join(f"| `{name}` | {value:.4g} |" for name, value in evals.items())
            parts.append(f"## Final evaluation\n\n| metric | value |\n|---|---|\n{table}")
            break
    urls = tracker_urls() if urls is None else urls
    if urls:
        parts.append("## Training logs\n\n" + "\n".join(f"- {name}: <{url}>" for name, url in urls.items()))
    return "\n\n".join(parts)


#: The headings of :func:`training_sections`, by which :func:`trainer_sections` finds them in a written card.
TRAINING_HEADINGS = ("## PPO-max settings", "## Final evaluation", "## Training logs")


def trainer_sections(folder: str | os.PathLike) -> list[str]:
    """The :func:`training_sections` of the card a trl-ppomax trainer wrote as ``folder/README.md`` (tagged
    ``trl-ppomax``), carried over into the card ``trl-ppomax push`` uploads; none without such a card."""
    path = Path(folder).expanduser() / "README.md"
    try:
        card = ModelCard.load(path) if path.is_file() else None
    except Exception:  # unreadable or not a card: nothing to carry over
        return []
    if card is None or "trl-ppomax" not in (card.data.tags or []):
        return []
    return [part.strip() for part in re.split(r"(?m)^(?=## )", card.text) if part.startswith(TRAINING_HEADINGS)]


def create_model_card(
    model,
    args,
    hub_model_id: str | None,
    model_name: str | None,
    dataset_name: str | None,
    tags,
    default_tags,
    log_history=None,
    model_type: str = "policy",
) -> ModelCard:
    """A trainer's model card (``model_type`` "policy" or "reward"): base model (a Hub id, never a local path),
    dataset, tags (:data:`TAGS`, ``default_tags``, ``tags``) and the :func:`training_sections`."""
    base_model = repo_like(getattr(getattr(model, "config", None), "_name_or_path", None))
    name = model_name or (args.output_dir.rstrip("/").split("/")[-1] if args.output_dir else "model")
    intro = trained_intro(model_type, base_model)
    if repo_like(dataset_name):
        intro += f" Training data: [`{dataset_name}`](https://huggingface.co/datasets/{dataset_name})."
    elif dataset_name:
        intro += f" Training data: `{dataset_name}`."
    return render_card(
        hub_model_id or name,
        model_type=model_type,
        intro=intro,
        sections=(training_sections(args, log_history), NO_LICENCE_SECTION),
        base_model=base_model,
        extra_tags=[*default_tags, *([tags] if isinstance(tags, str) else tags or [])],
        name=name,
        metadata={"model_name": name, "datasets": dataset_name},
    )


# -- Model cards for model folders (``trl-ppomax push``); trl_ppomax.moss.card builds on these. -----------------------
#: What a card calls each model type; the keys are the model types a card knows.
MODEL_KINDS = {
    "reward": "reward model",
    "sft": "supervised fine-tuned (SFT) dialogue model",
    "policy": "PPO-max policy",
}
#: The Hub pipeline tag of each model type.
PIPELINE_TAGS = {"reward": "text-classification", "sft": "text-generation", "policy": "text-generation"}
PAPER_URL = f"https://arxiv.org/abs/{PAPER_ID}"
#: The paper, as cards cite it in their text.
PAPER_LINK = f"*{PAPER_TITLE}* ([arXiv {PAPER_ID}]({PAPER_URL}))"
CHAT_TEMPLATE_SECTION = (
    "## Prompt format\n\nPrompts are formatted with the tokenizer's chat template "
    "(`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`)."
)
NO_LICENCE_SECTION = (
    "## Licence\n\nNo licence is set in this card: the weights follow the licence of the base model and "
    "of the training data; set `license:` in the metadata above. trl-ppomax itself is Apache-2.0."
)
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
#: Checkpoint internals (file names, at any depth) that :func:`push_folder` leaves out unless asked: optimizer,
#: scheduler and RNG states, the pickled training arguments, trainer/PPO states, DeepSpeed's helpers.
CHECKPOINT_FILES = (
    "optimizer.pt",
    "optimizer*.bin",
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "training_args.bin",
    "trainer_state.json",
    "ppo_state.json",
    "latest",
    "zero_to_fp32.py",
)
#: Checkpoint folders left out unless asked: the critic, DeepSpeed engine states, FSDP optimizer shards.
CHECKPOINT_DIRS = ("critic", "global_step*", "optimizer_*", "pytorch_model_fsdp_*")


def _check_folder(folder: str | os.PathLike) -> Path:
    path = Path(folder).expanduser()
    if not path.exists():
        raise ValueError(f"{path} does not exist: pass the folder written by `trainer.save_model` or `moss recover`.")
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder: pass the model folder (the one holding config.json).")
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        nested = sorted(p.parent.name for p in path.glob("*/config.json"))
        hint = f" (did you mean {', '.join(str(path / n) for n in nested)}?)" if nested else ""
        raise ValueError(
            f"{path} has no config.json or adapter_config.json: pass the model folder itself, the one written by "
            f"`save_pretrained` / `trainer.save_model` / `trl-ppomax moss recover`{hint}."
        )
    return path


def repo_like(value) -> str | None:
    """``value`` if it looks like a Hub repo id (``owner/name``, not a local path), else None."""
    looks_like = isinstance(value, str) and _REPO_ID.match(value) and not Path(value).expanduser().exists()
    return value if looks_like else None


@dataclass
class ModelFolder:
    """A model folder as a card sees it: its config.json and adapter_config.json (empty dicts when absent)."""

    path: Path
    config: dict
    adapter: dict

    @classmethod
    def read(cls, folder: str | os.PathLike) -> ModelFolder:
        """Raises ValueError when the folder is missing, holds neither file, or a JSON file is unreadable."""
        path = _check_folder(folder)
        config = read_json(path / "config.json") if (path / "config.json").is_file() else {}
        adapter = read_json(path / "adapter_config.json") if (path / "adapter_config.json").is_file() else {}
        return cls(path, config, adapter)

    @property
    def peft(self) -> bool:
        """A PEFT adapter without a full model."""
        return bool(self.adapter) and not self.config

    @property
    def model_type(self) -> str | None:
        """The type the folder implies: "reward" (a sequence classifier), "policy" (a causal LM) or None."""
        architectures = " ".join(self.config.get("architectures") or [])
        task = str(self.adapter.get("task_type") or "")
        if "ForSequenceClassification" in architectures or task == "SEQ_CLS":
            return "reward"
        if "ForCausalLM" in architectures or task == "CAUSAL_LM":
            return "policy"
        return None

    @property
    def base_model(self) -> str | None:
        """The Hub repo the model (or adapter) was loaded from, if its config names one."""
        return repo_like(self.adapter.get("base_model_name_or_path")) or repo_like(self.config.get("_name_or_path"))


#: Field names (or parts of them) that hold secrets; never written to disk.
SECRET_NAME = re.compile(r"(^|_)(token|api_key|password|secret)$")
NOT_SECRETS = frozenset({"stop_token"})


def without_secrets(args):
    """A shallow copy of ``args`` with every set secret string field (``hub_token``, ``*_token``, ``*_api_key``,
    ``*_password``, ``*_secret``; not ``stop_token``) set to None: what is written to ``training_args.bin``."""
    clean = copy.copy(args)
    for name, value in vars(args).items():
        if SECRET_NAME.search(name) and name not in NOT_SECRETS and isinstance(value, str) and value:
            object.__setattr__(clean, name, None)
    return clean


def redact_token(text: str) -> str:
    """``text`` with the Hub token (``HF_TOKEN`` or the login cache) replaced, should it ever appear in it."""
    token = get_token()
    return text.replace(token, "<redacted>") if token and len(token) >= 8 else text


def check_model_type(model_type: str | None) -> str | None:
    """``model_type`` if a card knows it (or None); a ValueError listing the known types otherwise."""
    if model_type is not None and model_type not in MODEL_KINDS:
        raise ValueError(f"Unknown model type {model_type!r}: use one of {', '.join(MODEL_KINDS)}.")
    return model_type


#: The usage section of a reward model's card (``str.format`` fields: note, repo_id, load).
REWARD_USAGE = """## Usage

{note}Score a conversation (higher is better); the score is read at the last token, so pad batches on the left:

```python
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

REPO = "{repo_id}"
tokenizer = AutoTokenizer.from_pretrained(REPO)
model = AutoModelForSequenceClassification.{load}

messages = [{{"role": "user", "content": "Hi"}}, {{"role": "assistant", "content": "Hello! How can I help you?"}}]
inputs = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True).to(model.device)
with torch.no_grad():
    score = model(**inputs).logits[0, 0].item()
```

As the reward model (and, by default, the initial critic) of PPO-max with
[trl-ppomax](https://pypi.org/project/trl-ppomax/):

```python
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from trl_ppomax import PPOMaxConfig, PPOMaxTrainer

trainer = PPOMaxTrainer(
    args=PPOMaxConfig(output_dir="ppo-max", report_to="none"),
    processing_class=tokenizer,  # the SFT model's tokenizer, padding on the left
    model=AutoModelForCausalLM.from_pretrained(SFT_MODEL),
    ref_model=None,  # a frozen copy of `model`
    reward_model=AutoModelForSequenceClassification.from_pretrained(REPO, num_labels=1),
    train_dataset=dataset,  # a "prompt" column (text or chat messages)
    value_model=None,  # None: the critic starts as a copy of the reward model (§5.3.3)
)
trainer.train()
```
"""

#: The usage section of a causal LM's card (fields: note, repo_id, load, trainer_note).
CAUSAL_LM_USAGE = """## Usage

{note}```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = "{repo_id}"
tokenizer = AutoTokenizer.from_pretrained(REPO)
model = AutoModelForCausalLM.{load}

messages = [{{"role": "user", "content": "Hi"}}]
inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
).to(model.device)
output = model.generate(**inputs, max_new_tokens=256, do_sample=True, top_p=0.9, temperature=0.8,
                        repetition_penalty=1.1)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```
{trainer_note}"""


def _usage_section(model_type: str | None, repo_id: str, peft: bool) -> str:
    load = 'from_pretrained(REPO, dtype=torch.bfloat16, device_map="auto")'
    note = (
        "This repository holds a PEFT adapter: `transformers` loads it on top of its base model when `peft` is "
        "installed.\n\n"
        if peft
        else ""
    )
    if model_type == "reward":
        return REWARD_USAGE.format(note=note, repo_id=repo_id, load=load)
    trainer_note = (
        "\nUse it as the `model` of `PPOMaxTrainer` (trl-ppomax) to train a PPO-max policy; the reference model "
        "defaults to a frozen copy of it.\n"
        if model_type == "sft"
        else ""
    )
    return CAUSAL_LM_USAGE.format(note=note, repo_id=repo_id, load=load, trainer_note=trainer_note)


def trained_intro(model_type: str | None, base_model: str | None) -> str:
    """The first paragraph of the card of a model trained with trl-ppomax."""
    what = MODEL_KINDS.get(model_type or "", "model")
    start = f", starting from [`{base_model}`](https://huggingface.co/{base_model})." if base_model else "."
    return (
        f"A {what} trained with [trl-ppomax](https://pypi.org/project/trl-ppomax/), the PPO-max recipe of "
        f"{PAPER_LINK} on the Hugging Face stack{start}"
    )


def render_card(
    repo_id: str,
    *,
    model_type: str | None,
    intro: str,
    prompt_section: str = CHAT_TEMPLATE_SECTION,
    sections: Sequence[str] = (NO_LICENCE_SECTION,),
    base_model: str | None = None,
    lang: str | None = None,
    license: str | None = None,
    peft: bool = False,
    extra_tags: Sequence[str] = (),
    name: str | None = None,
    metadata: dict | None = None,
) -> ModelCard:
    """A model card (README.md) for ``repo_id``: metadata (plus ``metadata``), ``# name`` (default: the repo's name),
    ``intro``, ``prompt_section``, the usage for ``model_type``, the non-empty ``sections`` and the paper's citation.
    Tags: :data:`TAGS`, ``extra_tags``, then "reward-model" or "text-generation", without repeats; any Hub token is
    redacted. Raises ValueError for a ``model_type`` not in :data:`MODEL_KINDS`."""
    check_model_type(model_type)
    tags = [*TAGS, *extra_tags]
    if model_type is not None:
        tags.append("reward-model" if model_type == "reward" else "text-generation")
    data = ModelCardData(
        base_model=base_model,
        language=[lang] if lang else None,
        library_name="peft" if peft else "transformers",
        license=license,
        pipeline_tag=PIPELINE_TAGS.get(model_type or ""),
        tags=list(dict.fromkeys(tags)),
        **(metadata or {}),
    )
    name = name or repo_id.rstrip("/").split("/")[-1]
    citation = f"## Citation\n\n{PAPER_TITLE} ([arXiv {PAPER_ID}]({PAPER_URL})):\n\n```bibtex\n{CITATION}\n```"
    parts = [intro, prompt_section, _usage_section(model_type, repo_id, peft), *sections, citation]
    body = "\n\n".join(s.strip("\n") for s in parts if s)
    return ModelCard(redact_token(f"---\n{data.to_yaml()}\n---\n\n# {name}\n\n{body}\n"))


def model_card(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    model_type: str | None = None,
    lang: str | None = None,
    base_model: str | None = None,
) -> ModelCard:
    """The generic trl-ppomax card (README.md, no licence) for a model folder about to be pushed to ``repo_id``, with
    the :func:`trainer_sections` of the card the trainer wrote there. ``model_type`` ("reward", "sft" or "policy"),
    ``lang`` and ``base_model`` override what config.json / adapter_config.json say. Raises ValueError as
    :meth:`ModelFolder.read`, or for an unknown ``model_type``.
    """
    folder = ModelFolder.read(folder)
    model_type = check_model_type(model_type or folder.model_type)
    base_model = base_model or folder.base_model
    return render_card(
        repo_id,
        model_type=model_type,
        intro=trained_intro(model_type, base_model),
        sections=(*trainer_sections(folder.path), NO_LICENCE_SECTION),
        base_model=base_model,
        lang=lang,
        peft=folder.peft,
    )


def check_weights(folder: str | os.PathLike) -> None:
    """A ValueError unless the model folder's config.json (or adapter_config.json) has its weights next to it, all
    of them whole: a save interrupted by a crash or a full disk must not reach the Hub."""
    from trl_ppomax.data.files import file_problem, weight_files

    root = _check_folder(folder)
    unfinished = "the save did not finish (a crash or a full disk?). Save the model again, then push."
    try:
        files = weight_files(root)
    except FileNotFoundError as err:
        raise ValueError(f"{root} has a config but no complete weights ({err}): {unfinished}") from err
    for path in files:
        if problem := file_problem(path):
            raise ValueError(f"{path} is damaged ({problem}): {unfinished}")


def upload_plan(folder: str | os.PathLike, include_internals: bool = False) -> tuple[list[str], list[str]]:
    """What :func:`push_folder` uploads from ``folder`` and what it leaves out (folders end with ``/``), as sorted
    relative POSIX paths; raises ValueError as :func:`check_weights`. Skipped silently: hidden files and folders,
    ``__pycache__``, ``*.pyc`` and the top-level README.md (the card replaces it). Left out and reported:
    ``checkpoint-*`` folders (push one by its own path) and, unless ``include_internals``, :data:`CHECKPOINT_FILES`
    and :data:`CHECKPOINT_DIRS`."""

    def internal(name: str, patterns: Sequence[str]) -> bool:
        return not include_internals and any(fnmatch.fnmatch(name, pattern) for pattern in patterns)

    root = _check_folder(folder)
    check_weights(root)
    files, excluded = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath).relative_to(root)
        dirs = [d for d in sorted(dirnames) if not d.startswith(".") and d != "__pycache__"]
        dirnames[:] = [d for d in dirs if not d.startswith("checkpoint-") and not internal(d, CHECKPOINT_DIRS)]
        excluded += [f"{(here / d).as_posix()}/" for d in dirs if d not in dirnames]
        for filename in filenames:
            rel = (here / filename).as_posix()
            if filename.startswith(".") or filename.endswith(".pyc") or rel == "README.md":
                continue
            (excluded if internal(filename, CHECKPOINT_FILES) else files).append(rel)
    return sorted(files), sorted(excluded)


def upload_files(folder: str | os.PathLike, include_internals: bool = False) -> list[str]:
    """The files of ``folder`` that :func:`push_folder` uploads: :func:`upload_plan`'s first list."""
    return upload_plan(folder, include_internals)[0]


@contextmanager
def staging_folder(root: Path, files: Sequence[str], card: str) -> Iterator[str]:
    """A temporary folder holding ``files`` (relative to ``root``) as symbolic links (or copies) and ``card`` as
    README.md, for ``HfApi.upload_folder``: the card is never written into the user's folder."""
    with tempfile.TemporaryDirectory(prefix="trl-ppomax-push-") as stage:
        for rel in files:
            target = Path(stage, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                target.symlink_to((root / rel).resolve())
            except OSError:  # no symbolic links (Windows without developer mode): a copy
                shutil.copy2(root / rel, target)
        Path(stage, "README.md").write_text(card, encoding="utf-8")
        yield stage


@dataclass
class PushResult:
    """What :func:`push_folder` did: the uploaded paths (README.md last), repo URL and commit (None in a dry run)."""

    files: list[str]
    card: ModelCard
    repo_url: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None
    #: What was left out (checkpoint internals, ``checkpoint-*`` folders), see :func:`upload_plan`.
    excluded: list[str] = field(default_factory=list)


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    card: ModelCard | str | None = None,
    api: HfApi | None = None,
    include_internals: bool = False,
) -> PushResult:
    """Upload a model folder and its model card to the Hub model repo ``repo_id`` in one commit; returns a
    :class:`PushResult` (in a dry run, where nothing is sent, of what would be uploaded).

    :func:`upload_plan`'s files (checkpoint internals left out, with a warning, unless ``include_internals``) and
    README.md (``card``, by default :func:`model_card`) go up with one ``HfApi.upload_folder`` call on a
    :func:`staging_folder` (with ``hf_xet`` a very large folder goes up in several resumable commits). Creates the
    repo (``private`` only applies then) and, for a ``revision`` other than "main", the branch. The token comes from
    huggingface_hub (``HF_TOKEN`` or ``hf auth login``), never from an argument. Raises ValueError for an invalid
    ``repo_id``, or as :func:`upload_plan`.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"Invalid --repo-id {repo_id!r}: {err}") from err
    root = _check_folder(folder)
    files, excluded = upload_plan(root, include_internals)
    if excluded:
        hint = "pass include_internals=True / --include-checkpoint-files to upload them"
        logger.warning("Not uploading checkpoint files from %s: %s (%s).", root, ", ".join(excluded), hint)
    card = card if card is not None else model_card(root, repo_id)
    card = card if isinstance(card, ModelCard) else ModelCard(str(card))
    paths = [*files, "README.md"]
    if dry_run:
        return PushResult(paths, card, excluded=excluded)
    api = api or HfApi()
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision and revision != "main":
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    message = commit_message or f"Upload {root.name} with trl-ppomax"
    with staging_folder(root, files, redact_token(str(card))) as staged:
        info = api.upload_folder(
            repo_id=repo_id, folder_path=staged, commit_message=message, repo_type="model", revision=revision
        )
    url = str(repo_url) if repo_url else f"https://huggingface.co/{repo_id}"
    oid, commit_url = getattr(info, "oid", None), getattr(info, "commit_url", None)
    return PushResult(paths, card, repo_url=url, commit_url=commit_url, commit_oid=oid, excluded=excluded)
