"""Model cards, Hub metadata and ``trl-ppomax push``.

:func:`create_model_card` is the card ``PPOMaxTrainer.push_to_hub`` writes; :func:`moss_model_card` and
:func:`push_folder` upload a converted MOSS-RLHF model or any trained model folder with a generated card.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id
from trl.trainer.utils import generate_model_card

PAPER_TITLE = "Secrets of RLHF in Large Language Models Part I: PPO"
PAPER_ID = "2307.04964"
CITATION = """\
@article{zheng2023secrets,
    title        = {{Secrets of RLHF in Large Language Models Part I: PPO}},
    author       = {Rui Zheng and Shihan Dou and Songyang Gao and others},
    year         = 2023,
    journal      = {arXiv preprint arXiv:2307.04964}
}"""
TAGS = ["trl", "trl-ppomax", "ppo", "ppo-max", "rlhf"]


def create_model_card(
    model, args, hub_model_id: str | None, model_name: str | None, dataset_name: str | None, tags, default_tags
) -> ModelCard:
    """A model card for a PPO-max policy: base model, tags ``trl-ppomax``/``ppo-max`` and the paper's citation."""
    config = getattr(model, "config", None)
    base_model = getattr(config, "_name_or_path", None) or None
    extra = [tags] if isinstance(tags, str) else list(tags or [])
    all_tags = list(dict.fromkeys([*default_tags, *TAGS, *extra]))
    return generate_model_card(
        base_model=base_model,
        model_name=model_name or (args.output_dir.rstrip("/").split("/")[-1] if args.output_dir else "model"),
        hub_model_id=hub_model_id or "",
        dataset_name=dataset_name,
        tags=all_tags,
        wandb_url=None,
        trackio_url=None,
        trainer_name="PPO-max (trl-ppomax)",
        trainer_citation=CITATION,
        paper_title=PAPER_TITLE,
        paper_id=PAPER_ID,
    )


# --------------------------------------------------------------------------------------------------------------------
# Model cards for converted MOSS-RLHF models and folders trained with trl-ppomax; ``trl-ppomax push``.
# --------------------------------------------------------------------------------------------------------------------

#: The file our MOSS-RLHF converter writes next to the weights (keys: model_type, lang, source_diff, source_raw,
#: expected_sum, recovery_command; all optional).
CONVERSION_FILE = "trl_ppomax_conversion.json"
#: Model types a card knows: the reward model, the SFT model and the PPO(-max) policy.
MODEL_TYPES = ("reward", "sft", "policy")
#: The published weight diffs, by ``(model_type, lang)``.
MOSS_RELEASES = {
    ("reward", "en"): "fnlp/moss-rlhf-reward-model-7B-en",
    ("sft", "en"): "fnlp/moss-rlhf-sft-model-7B-en",
    ("policy", "en"): "fnlp/moss-rlhf-policy-model-7B-en",
    ("reward", "zh"): "Ablustrund/moss-rlhf-reward-model-7B-zh",
}
#: Speaker tags of the MOSS-RLHF prompt format, by language: ``(human, assistant)``.
MOSS_SPEAKERS = {"en": ("Human:", "Assistant:"), "zh": ("<|Human|>", "<|MOSS|>")}
_PAPER_URL = f"https://arxiv.org/abs/{PAPER_ID}"
_SKIP_DIRS = {"__pycache__"}
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"Could not read {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def _check_folder(folder: str | os.PathLike) -> Path:
    path = Path(folder).expanduser()
    if not path.exists():
        raise ValueError(
            f"{path} does not exist: pass the model folder written by `trl-ppomax moss recover` or "
            "`trainer.save_model(...)`."
        )
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


def _infer_model_type(config: dict, adapter: dict) -> str | None:
    architectures = " ".join(config.get("architectures") or [])
    task = str(adapter.get("task_type") or "")
    if "ForSequenceClassification" in architectures or task == "SEQ_CLS":
        return "reward"
    if "ForCausalLM" in architectures or task == "CAUSAL_LM":
        return "policy"
    return None


def _repo_like(value) -> str | None:
    """``value`` if it looks like a Hub repo id (``owner/name``, not a local path), else None."""
    if isinstance(value, str) and _REPO_ID.match(value) and not Path(value).expanduser().exists():
        return value
    return None


def redact_token(text: str) -> str:
    """``text`` with the Hub token (``HF_TOKEN`` or the login cache) replaced, should it ever appear in it."""
    token = get_token()
    return text.replace(token, "<redacted>") if token and len(token) >= 8 else text


def _prompt_section(lang: str | None) -> str:
    langs = [lang] if lang in MOSS_SPEAKERS else list(MOSS_SPEAKERS)
    lines = [
        "## Prompt format",
        "",
        "Turns alternate, each prefixed with its speaker tag and **no space**, and are joined by the eos token "
        "`</s>`; the prompt ends with eos and the assistant's tag, and the model continues from there (ending its "
        "answer with `</s>`). When a conversation is too long, drop the oldest turns first.",
        "",
    ]
    examples = {}
    for code in langs:
        human, assistant = MOSS_SPEAKERS[code]
        content = "Hi" if code == "en" else "你好"
        examples[code] = (content, f"{human}{content}</s>{assistant}")
        name = "English" if code == "en" else "Chinese"
        lines.append(f"- {name}: `{human}` / `{assistant}`, e.g. `{examples[code][1]}`")
    content, example = examples[langs[0]]
    lines += [
        "",
        "The tokenizer's chat template produces this string: `tokenizer.apply_chat_template("
        f'[{{"role": "user", "content": "{content}"}}], tokenize=False, add_generation_prompt=True)` '
        f"gives `{example}`.",
    ]
    return "\n".join(lines)


def _usage_section(model_type: str | None, repo_id: str, peft: bool) -> str:
    load = 'from_pretrained(REPO, dtype=torch.bfloat16, device_map="auto")'
    if peft:
        note = (
            "This repository holds a PEFT adapter: `transformers` loads it on top of its base model when "
            "`peft` is installed.\n\n"
        )
    else:
        note = ""
    if model_type == "reward":
        return f"""## Usage

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
    trainer_note = (
        "\nUse it as the `model` of `PPOMaxTrainer` (trl-ppomax) to train a PPO-max policy; the reference model "
        "defaults to a frozen copy of it.\n"
        if model_type == "sft"
        else ""
    )
    return f"""## Usage

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


def _citation_section() -> str:
    return f"## Citation\n\n{PAPER_TITLE} ([arXiv {PAPER_ID}]({_PAPER_URL})):\n\n```bibtex\n{CITATION}\n```\n"


def moss_model_card(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    model_type: str | None = None,
    lang: str | None = None,
    base_model: str | None = None,
) -> ModelCard:
    """The model card (README.md) for a model folder about to be pushed to ``repo_id``.

    A folder converted from MOSS-RLHF (it holds :data:`CONVERSION_FILE`) gets a MOSS-RLHF card: licence
    ``agpl-3.0``, the source diff as ``base_model``, the prompt format, usage and the recovery command. Any other
    folder (e.g. a model trained with trl-ppomax) gets a generic trl-ppomax card that sets no licence.
    ``model_type`` ("reward", "sft" or "policy"), ``lang`` ("en" or "zh") and ``base_model`` override what the
    conversion file and config.json say.

    Raises:
        ValueError: the folder is missing or holds no config.json / adapter_config.json, a JSON file is
            unreadable, or ``model_type`` / ``lang`` is unknown.
    """
    path = _check_folder(folder)
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    adapter = _read_json(path / "adapter_config.json") if (path / "adapter_config.json").is_file() else {}
    converted = (path / CONVERSION_FILE).is_file()
    conversion = _read_json(path / CONVERSION_FILE) if converted else {}

    model_type = model_type or conversion.get("model_type") or _infer_model_type(config, adapter)
    if model_type is not None and model_type not in MODEL_TYPES:
        raise ValueError(f"Unknown model type {model_type!r}: use one of {', '.join(MODEL_TYPES)}.")
    lang = lang or conversion.get("lang")
    if lang is not None and lang not in MOSS_SPEAKERS:
        raise ValueError(f"Unknown language {lang!r}: use one of {', '.join(MOSS_SPEAKERS)}.")
    base_model = base_model or _repo_like(conversion.get("source_diff"))
    if base_model is None and converted:
        base_model = MOSS_RELEASES.get((model_type, lang or "en"))
    if base_model is None:
        base_model = _repo_like(adapter.get("base_model_name_or_path")) or _repo_like(config.get("_name_or_path"))
    moss = converted or "moss-rlhf" in (base_model or "").lower()
    peft = bool(adapter) and not config

    tags = ["trl-ppomax", "ppo-max", "rlhf"] + (["moss-rlhf"] if moss else [])
    pipeline_tag = {"reward": "text-classification", "sft": "text-generation", "policy": "text-generation"}.get(
        model_type or ""
    )
    if model_type == "reward":
        tags.append("reward-model")
    elif model_type is not None:
        tags.append("text-generation")
    data = ModelCardData(
        base_model=base_model,
        language=[lang] if lang else None,
        library_name="peft" if peft else "transformers",
        license="agpl-3.0" if moss else None,
        pipeline_tag=pipeline_tag,
        tags=tags,
    )

    name = repo_id.rstrip("/").split("/")[-1]
    what = {
        "reward": "reward model",
        "sft": "supervised fine-tuned (SFT) dialogue model",
        "policy": "PPO-max policy",
        None: "model",
    }[model_type]
    paper = f"*{PAPER_TITLE}* ([arXiv {PAPER_ID}]({_PAPER_URL}))"
    if converted:
        language = {"en": "English ", "zh": "Chinese "}.get(lang or "", "")
        source = f" [`{base_model}`](https://huggingface.co/{base_model})" if base_model else ""
        intro = (
            f"The {language}MOSS-RLHF {what} released with {paper}, recovered from the published weight "
            f"diff{source} against LLaMA-7B and converted to the standard `transformers` format with trl-ppomax."
        )
        if model_type == "reward":
            intro += (
                " It is a `LlamaForSequenceClassification` with `num_labels=1`: the release's `reward_head` is "
                "`score.weight`, and the reward is read at the last token of prompt + response."
            )
    else:
        intro = (
            f"A {what} trained with [trl-ppomax](https://pypi.org/project/trl-ppomax/), the PPO-max recipe of "
            f"{paper} on the Hugging Face stack"
            + (f", starting from [`{base_model}`](https://huggingface.co/{base_model})." if base_model else ".")
        )
    sections = [
        intro,
        _prompt_section(lang)
        if moss
        else "## Prompt format\n\nPrompts are formatted with the tokenizer's chat template "
        "(`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`).",
        _usage_section(model_type, repo_id, peft),
    ]
    if converted:
        recovery = conversion.get("recovery_command") or " ".join(
            [
                "trl-ppomax moss recover",
                f"--raw {shlex.quote(str(conversion.get('source_raw') or '/path/to/llama-7b-hf'))}",
                f"--diff {shlex.quote(str(conversion.get('source_diff') or base_model or '/path/to/diff'))}",
                f"--output {shlex.quote('./' + name)}",
                f"--model-type {model_type or 'reward'}",
                f"--lang {lang or 'en'}",
            ]
        )
        check = (
            f" The recovery checks that the sum of all recovered parameters (float32) is `{conversion['expected_sum']}`."
            if conversion.get("expected_sum") is not None
            else ""
        )
        sections.append(
            "## How these weights were made\n\n"
            "The release stores `tuned − raw` for every parameter whose name contains `layers` (other tensors "
            f"whole); recovery adds the raw LLaMA-7B weights back.{check}\n\n```bash\n{recovery}\n```"
        )
    if moss:
        sections.append(
            "## Licence\n\n"
            "The MOSS-RLHF model weights are released under the **GNU AGPL-3.0**, so these derived weights are "
            "AGPL-3.0 as well (LLaMA's own licence terms also apply to the base weights). The MOSS-RLHF code is "
            "Apache-2.0 and its data CC BY-NC 4.0; trl-ppomax is Apache-2.0."
        )
    else:
        sections.append(
            "## Licence\n\nNo licence is set in this card: the weights follow the licence of the base model and "
            "of the training data; set `license:` in the metadata above. trl-ppomax itself is Apache-2.0."
        )
    body = f"# {name}\n\n" + "\n\n".join(s.strip("\n") for s in sections) + "\n\n" + _citation_section()
    return ModelCard(redact_token(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def upload_files(folder: str | os.PathLike) -> list[str]:
    """The files of ``folder`` that :func:`push_folder` uploads, as sorted relative POSIX paths.

    Skips hidden files and folders (``.git``, ``.tmp-*`` …), ``checkpoint-*`` and ``__pycache__`` folders, ``*.pyc``
    and the folder's own top-level README.md (the generated card replaces it).
    """
    root = _check_folder(folder)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if not (d.startswith(".") or d.startswith("checkpoint-") or d in _SKIP_DIRS)
        ]
        for filename in filenames:
            if filename.startswith(".") or filename.endswith(".pyc"):
                continue
            rel = (Path(dirpath) / filename).relative_to(root).as_posix()
            if rel != "README.md":
                files.append(rel)
    return sorted(files)


@dataclass
class PushResult:
    """What :func:`push` did: the uploaded paths (README.md last), the repo URL and the commit (None in a dry run)."""

    files: list[str]
    card: ModelCard
    repo_url: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None


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
) -> PushResult:
    """Upload a model folder and its model card to the Hub model repo ``repo_id`` in one commit.

    Uploads :func:`upload_files` plus README.md (``card``, by default :func:`moss_model_card`). Creates the repo
    (``private`` only applies then) and, for a ``revision`` other than "main", the branch. The token comes from
    huggingface_hub (``HF_TOKEN`` or ``hf auth login``), never from an argument. With ``dry_run`` nothing is sent.
    ``api`` defaults to ``HfApi()``.

    Returns:
        A :class:`PushResult`: the uploaded (or, in a dry run, to-be-uploaded) relative paths, README.md last, the
        card, and the repo and commit URLs.

    Raises:
        ValueError: an invalid ``repo_id``, or the folder is missing or holds no config.json /
            adapter_config.json.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"Invalid --repo-id {repo_id!r}: {err}") from err
    root = _check_folder(folder)
    files = upload_files(root)
    card = card if card is not None else moss_model_card(root, repo_id)
    card = card if isinstance(card, ModelCard) else ModelCard(str(card))
    paths = [*files, "README.md"]
    if dry_run:
        return PushResult(paths, card)
    api = api or HfApi()
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision and revision != "main":
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(root / rel)) for rel in files]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=redact_token(str(card)).encode()))
    info = api.create_commit(
        repo_id,
        operations=operations,
        commit_message=commit_message or f"Upload {root.name} with trl-ppomax",
        repo_type="model",
        revision=revision,
    )
    return PushResult(
        paths,
        card,
        repo_url=str(repo_url) if repo_url else f"https://huggingface.co/{repo_id}",
        commit_url=getattr(info, "commit_url", None),
        commit_oid=getattr(info, "oid", None),
    )
