"""The commands that write or publish model folders: ``tiny``, ``consolidate``, ``push`` and ``moss recover``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trl_ppomax.cli.arguments import add_command, fail


def save_tiny(args: argparse.Namespace) -> int:
    """Write tiny offline models (sft/, reward/) and datasets (prompts.jsonl, preferences.jsonl) to a folder."""
    from trl_ppomax.toyworld.tiny import save_tiny_models

    try:
        paths = save_tiny_models(args.output_dir, arch=args.arch, seed=args.seed, overwrite=args.overwrite)
    except ValueError as err:
        return fail("tiny", err)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def consolidate(args: argparse.Namespace) -> int:
    """Turn a folder holding only DeepSpeed's sharded engine checkpoint (a ZeRO-3 run without
    stage3_gather_16bit_weights_on_model_save) into plain transformers folders: the policy, and critic/ or
    value_model/ beside it. The folder is checked first; only the consolidation itself needs DeepSpeed."""
    from trl_ppomax.ppo.engine_checkpoint import CRITIC_FOLDERS, consolidate_engine_checkpoint

    try:
        output = consolidate_engine_checkpoint(args.folder, args.output)
    except (ValueError, OSError, ImportError) as err:  # no engine checkpoint, DeepSpeed missing: one line, exit 2
        return fail("consolidate", err)
    print(f"policy: {output}")
    for name in CRITIC_FOLDERS:
        if (Path(output) / name / "config.json").is_file():
            print(f"critic: {Path(output) / name}")
    return 0


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def push_model(args: argparse.Namespace) -> int:
    """Upload a model folder (converted or trained) to the Hub with a generated model card, in one commit."""
    from trl_ppomax.moss.card import moss_model_card  # the MOSS-RLHF card for a converted folder, else the generic one
    from trl_ppomax.reporting import hub

    try:
        card = moss_model_card(
            args.folder, args.repo_id, model_type=args.model_type, lang=args.lang, base_model=args.base_model
        )
        result = hub.push_folder(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            dry_run=args.dry_run,
            card=card,
            include_internals=args.include_checkpoint_files,
        )
    except Exception as err:  # invalid folder / repo id, or any Hub or network error: one line, exit 2
        message = str(err) if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {err}"
        return fail("push", hub.redact_token(message))
    root = Path(args.folder).expanduser()
    if result.excluded:
        print(
            f"trl-ppomax push: not uploading {len(result.excluded)} checkpoint file(s): {', '.join(result.excluded)} "
            "(pass --include-checkpoint-files to upload them)",
            file=sys.stderr,
        )
    if args.dry_run:
        sizes = {rel: (root / rel).stat().st_size for rel in result.files[:-1]}
        where = f"{args.repo_id} ({'private' if args.private else 'public'}, revision {args.revision or 'main'})"
        print(f"Dry run: would upload {len(result.files)} files ({_size(sum(sizes.values()))}) to {where}:")
        for rel, size in sizes.items():
            print(f"  {rel:<40} {_size(size):>10}")
        print(f"  {'README.md':<40} {'(card)':>10}")
        print("\n--- README.md ---")
        print(hub.redact_token(str(result.card)))
        return 0
    print(f"Pushed {len(result.files)} files to {result.repo_url}")
    if result.commit_url:
        print(f"Commit: {result.commit_url}")
    return 0


def recover_moss(args: argparse.Namespace) -> int:
    """Recover a MOSS-RLHF release model from its weight diff and LLaMA-7B, as a standard transformers model."""
    from trl_ppomax.moss.recovery import recover, resolve_source

    if args.expected_sum is not None and args.skip_integrity_check:
        return fail("moss recover", "use --expected-sum or --skip-integrity-check, not both")
    try:
        output = recover(
            resolve_source(args.raw, "--raw"),
            resolve_source(args.diff, "--diff"),
            args.output,
            args.model_type,
            lang=args.lang,
            expected_sum=args.expected_sum,
            check=not args.skip_integrity_check,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
        )
    except (ValueError, OSError, KeyError) as err:
        return fail("moss recover", err)
    print(f"Recovered {args.lang} {args.model_type} model: {output}")
    return 0


def _add_push(commands) -> None:
    note = " The token comes from the HF_TOKEN environment variable or `hf auth login`, never the command line."
    push = add_command(commands, "push", push_model, note)
    push.add_argument("folder", metavar="DIR", help="model folder with config.json (or adapter_config.json)")
    push.add_argument("--repo-id", required=True, metavar="NAME", help="Hub model repo, e.g. user/my-model")
    push.add_argument("--private", action="store_true", help="create the repo private (if it does not exist yet)")
    push.add_argument("--revision", metavar="REV", help="branch to commit to (created if missing; default: main)")
    push.add_argument("--commit-message", metavar="MSG", help="commit message")
    push.add_argument("--dry-run", action="store_true", help="print the files and the card, upload nothing")
    push.add_argument("--model-type", choices=["reward", "sft", "policy"], help="override the card's model type")
    push.add_argument("--lang", choices=["en", "zh"], help="override the card's language")
    push.add_argument("--base-model", metavar="REPO", help="override the card's base_model")
    push.add_argument(
        "--include-checkpoint-files",
        action="store_true",
        help="also upload checkpoint internals (optimizer/scheduler/RNG states, training_args.bin, trainer and PPO "
        "states, critic/, DeepSpeed folders), left out by default",
    )


def _add_moss(commands) -> None:
    moss = commands.add_parser("moss", help="the paper's released models (MOSS-RLHF)").add_subparsers(
        dest="moss_command", required=True
    )
    recover = add_command(moss, "recover", recover_moss)
    recover.add_argument("--raw", required=True, help="LLaMA-7B in Hugging Face format: a folder or a Hub id")
    recover.add_argument("--diff", required=True, help="the release's diff: a folder or a Hub id")
    recover.add_argument("--output", required=True, help="folder to write (must be absent or empty)")
    recover.add_argument("--model-type", required=True, choices=["reward", "sft", "policy"], help="which model")
    recover.add_argument("--lang", choices=["en", "zh"], default="en", help="the release's language")
    recover.add_argument("--expected-sum", type=float, help="override the published parameter sum")
    recover.add_argument("--skip-integrity-check", action="store_true", help="do not check the parameter sum")
    recover.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="dtype of the written weights"
    )
    recover.add_argument("--max-shard-size", default="2GB", help="size of the output shards, e.g. 500MB or 5GB")


def add(commands) -> None:
    tiny = add_command(commands, "tiny", save_tiny)
    tiny.add_argument("output_dir", metavar="OUTPUT_DIR", help="folder to create (must be absent or empty)")
    tiny.add_argument("--arch", choices=["llama", "gpt_neox"], default="llama", help="model architecture")
    tiny.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    tiny.add_argument("--overwrite", action="store_true", help="replace OUTPUT_DIR even if it is not empty")
    merge = add_command(commands, "consolidate", consolidate)
    merge.add_argument("folder", metavar="DIR", help="a checkpoint-N or save_model folder of the run")
    merge.add_argument("--output", metavar="DIR", help="where to write the plain folders (default: DIR itself)")
    _add_push(commands)
    _add_moss(commands)
