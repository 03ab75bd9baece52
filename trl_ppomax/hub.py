"""Model cards and Hub metadata for models trained with trl-ppomax."""

from __future__ import annotations

from huggingface_hub import ModelCard
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
