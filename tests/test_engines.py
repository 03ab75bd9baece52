"""Every engine on CPU: 2 processes through ``accelerate launch`` with the shipped ``recipes/accelerate/*_cpu.yaml``
configs, running ``tests/scripts/engine_run.py`` (4 PPO-max iterations of the tiny models, a checkpoint every 2).

For each engine: it trains; a run stopped after iteration 2 and resumed ends exactly where an uninterrupted run
ends; ``save_model`` writes a plain transformers model that loads without the engine and gives the in-process
logits; the running reward moments are the same on both ranks. Plus a simulated 2-node run (one process per
``machine_rank``, meeting at 127.0.0.1), and the ``ppo`` / ``reward`` commands and the recipe under ZeRO-2/3 with a
DeepSpeed JSON of the user's own (explicit batch sizes), loading their models from disk; and ZeRO-3 with a JSON that
does not set ``stage3_gather_16bit_weights_on_model_save``: checkpoints and ``save_model`` hold the sharded engine
checkpoint, a resume continues from it, and it consolidates into plain models (the policy, critic/ and value_model/,
which warm-starts a run). Slow (a few minutes on 2 cores):
``pytest -m slow tests/test_engines.py``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "engine_run.py"
CONFIGS = ROOT / "recipes" / "accelerate"
#: Every run: critic warm-up in iteration 1, with weight decay (which must not move the policy during warm-up).
COMMON = ("--critic-warmup", "1", "--weight-decay", "0.1")
STEPS = 4

#: engine id -> (accelerate config, worker options, the engine the worker must report)
ENGINES = {
    "zero2": ("deepspeed_zero2_cpu.yaml", (), "deepspeed-zero2"),
    "zero3": ("deepspeed_zero3_cpu.yaml", (), "deepspeed-zero3"),
    "zero3-no-gather": ("deepspeed_zero3_cpu.yaml", ("--no-ds3-gather",), "deepspeed-zero3"),
    # accelerate drops FSDP for CPU process groups; --fsdp-on-cpu makes it build FSDP2 anyway (see engine_run.py)
    "fsdp2": ("fsdp2_cpu.yaml", ("--fsdp-on-cpu",), "fsdp2"),
}
PARAMS = list(ENGINES)
ENV = {
    **os.environ,
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "WANDB_DISABLED": "true",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(config: str, output: Path, *worker_args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / config),
        "--num_processes",
        "2",
        *(launcher or ("--main_process_port", str(free_port()))),
        str(WORKER),
        str(output),
        *worker_args,
    ]


def failure_tail(text: str) -> str:
    """The end of a launch's output without the warnings every DeepSpeed/FSDP step prints."""
    noise = ("FutureWarning", "return func(", "Writing model shards", "Loading weights", "warnings.warn(")
    return "\n".join(line for line in text.splitlines() if not any(n in line for n in noise))[-4000:]


def ranks(output: Path) -> list[dict]:
    return [json.loads((output / f"rank{r}.json").read_text()) for r in (0, 1)]


#: DeepSpeed's CPU processes now and then abort in native code ("terminate called without an active exception"),
#: seen when other DeepSpeed jobs ran on the same machine at the same time; such a launch is tried once more.
NATIVE_ABORT = "terminate called without an active exception"


def launch(config: str, output: Path, *worker_args: str) -> list[dict]:
    return launch_logged(config, output, *worker_args)[0]


def launch_logged(config: str | Path, output: Path, *worker_args: str) -> tuple[list[dict], str]:
    """:func:`launch`, also returning the launch's stderr (the trainer's warnings)."""
    command = launch_command(str(config), output, *worker_args)
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if result.returncode != 0 and NATIVE_ABORT in result.stderr:
        if "--resume" not in worker_args:  # a fresh run refuses a folder holding the aborted attempt's checkpoints
            shutil.rmtree(output, ignore_errors=True)
        result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"accelerate launch failed ({result.returncode}):\n{failure_tail(result.stderr)}")
    return ranks(output), result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(engine)``: the uninterrupted run and the stopped-then-resumed run of ``engine`` (each launched once per
    module, one after the other; a failed launch fails every test of that engine)."""
    cache: dict[str, dict | Exception] = {}

    def get(engine: str) -> dict:
        config, options, _ = ENGINES[engine]
        if "deepspeed" in config:
            pytest.importorskip("deepspeed")
        if engine not in cache:
            root = tmp_path_factory.mktemp(engine)
            try:
                full = launch(config, root / "full", *COMMON, *options)
                launch(config, root / "resumed", *COMMON, *options, "--stop-at", "2")
                resumed = launch(config, root / "resumed", *COMMON, *options, "--resume")
                cache[engine] = {"full": full, "resumed": resumed, "dir": root}
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
                cache[engine] = error
        if isinstance(cache[engine], Exception):
            pytest.fail(str(cache[engine]), pytrace=False)
        return cache[engine]

    return get


@pytest.mark.parametrize("engine", PARAMS)
def test_engine_trains(runs, engine):
    full = runs(engine)["full"]
    main = full[0]
    assert [r["engine"] for r in full] == [ENGINES[engine][2]] * 2  # the engine really ran (not DDP)
    assert main["world_size"] == 2 and main["global_step"] == STEPS
    assert main["metrics"] and len(main["metrics"]) == STEPS and main["metrics_finite"]
    start, warm, end = main["checksum_initial"], main["checksum_after_warmup"], main["checksum"]
    # Critic warm-up (iteration 1) moves the critic only, weight decay included; then both models train.
    assert warm["policy"] == start["policy"] and warm["critic"] != start["critic"]
    assert end["policy"] != start["policy"] and end["critic"] != warm["critic"]


@pytest.mark.parametrize("engine", PARAMS)
def test_resume_is_exact(runs, engine):
    """Stopped after iteration 2 (checkpoint-2) and resumed: the same weights, moments, counters and logits as the
    uninterrupted run — the optimizer, scheduler, RNG, data position and PPO state all come back."""
    run = runs(engine)
    full, resumed = run["full"], run["resumed"]
    assert (run["dir"] / "resumed" / "checkpoint-2").is_dir()
    for a, b in zip(full, resumed, strict=True):
        assert b["global_step"] == a["global_step"] == STEPS
        assert b["counters"] == a["counters"]
        assert b["moments"]["count"] == a["moments"]["count"]
        assert b["moments"] == pytest.approx(a["moments"], rel=1e-9, abs=1e-12)
        assert b["logits_sum"] == pytest.approx(a["logits_sum"], rel=1e-9)
    assert resumed[0]["checksum"] == pytest.approx(full[0]["checksum"], rel=1e-9)
    assert torch.allclose(torch.tensor(resumed[0]["logits"]), torch.tensor(full[0]["logits"]), atol=1e-6)


@pytest.mark.parametrize("engine", PARAMS)
def test_saved_policy_loads_without_the_engine(runs, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = runs(engine)
    folder, main = run["dir"] / "full" / "policy", run["full"][0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(main["fixed_input"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.allclose(logits, torch.tensor(main["logits"]), atol=1e-5, rtol=1e-5)
    total = sum(t.double().sum().item() for t in model.state_dict().values())
    assert total == pytest.approx(main["checksum"]["policy"], rel=1e-9)


@pytest.mark.parametrize("engine", PARAMS)
def test_running_moments_identical_on_both_ranks(runs, engine):
    for run in (runs(engine)["full"], runs(engine)["resumed"]):
        assert run[0]["moments"] == run[1]["moments"]  # global statistics: bit-identical on every rank
        assert run[0]["moments"]["count"] == 16 * STEPS
        assert run[0]["counters"] == run[1]["counters"]
        assert run[0]["logits_sum"] == run[1]["logits_sum"]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_critic_warmup_leaves_the_policy_adam_state_alone(runs, engine):
    """Under DeepSpeed the policy's gradients during warm-up are zeros, not absent: the trainer restarts its Adam
    step counter when the policy starts training (optim.restart_policy_adam), so its bias correction is right."""
    main = runs(engine)["full"][0]
    assert main["adam_steps_after_warmup"] == {"policy": 0, "critic": 2}  # 2 epochs × 1 minibatch of critic steps


def test_simulated_two_nodes(tmp_path):
    """Two launchers, machine_rank 0 and 1, one process each, meeting at 127.0.0.1 (multi_node_cpu.yaml)."""
    port = str(free_port())
    commands = [
        launch_command(
            "multi_node_cpu.yaml",
            tmp_path,
            *COMMON,
            "--stop-at",
            "2",
            launcher=(
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
            ),
        )
        for rank in (0, 1)
    ]
    nodes = [
        subprocess.Popen(c, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    try:
        errors = [node.communicate(timeout=600)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, error in zip(nodes, errors, strict=True):
        assert node.returncode == 0, failure_tail(error)
    node0, node1 = ranks(tmp_path)
    assert node0["engine"] == node1["engine"] == "ddp" and node0["world_size"] == 2
    assert node0["global_step"] == node1["global_step"] == 2
    assert node0["moments"] == node1["moments"] and node0["moments"]["count"] == 32
    assert node0["counters"] == node1["counters"]
    assert node0["checksum_after_warmup"]["policy"] == node0["checksum_initial"]["policy"]
    assert node0["adam_steps_after_warmup"] == {"policy": 0, "critic": 2}  # DDP: the policy's Adam state untouched


def test_zero3_generation_gathers_the_policy_only(tmp_path):
    """Under ZeRO-3 with ds3_gather_for_generation, generation holds the whole policy and none of the critic (every
    parameter partitioned: stage3_param_persistence_threshold 0), measured by benchmarks/engine_memory.py."""
    output = tmp_path / "memory.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "engine_memory.py"),
        "--runs",
        "zero3",
        "--output",
        str(output),
    ]
    # as from a virtual environment that is not activated: no `accelerate` on PATH (the benchmark launches through
    # its interpreter)
    path = os.pathsep.join(p for p in ENV.get("PATH", "").split(os.pathsep) if not (Path(p) / "accelerate").exists())
    result = subprocess.run(command, env={**ENV, "PATH": path}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    (run,) = json.loads(output.read_text())["summary"]
    held, full = run["measured_max_over_ranks"], run["full_size"]
    assert held["gen_policy"] == full["policy"]  # the whole policy, gathered for generate()
    assert held["gen_critic"] == 0  # the critic stays sharded
    assert held["params"] == full["trained"] // 2  # and outside generation every rank holds half of each


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp2"])
def test_non_finite_gradients_are_skipped_and_counted(tmp_path, engine):
    """NaN gradients in iteration 3: its optimizer steps are skipped and counted (under DeepSpeed the engine skips
    them and the trainer reads that back), the weights stay finite, and the run finishes."""
    config, options, _ = ENGINES[engine]
    run = launch(config, tmp_path, *options, "--nan-grad-at", "3")
    main = run[0]
    assert main["global_step"] == STEPS
    assert main["counters"]["skipped/updates"] == 2  # 2 epochs × 1 minibatch in iteration 3
    assert all(math.isfinite(v) for v in main["checksum"].values())


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_token_budget_micro_batches_and_samples_per_prompt_under_zero(tmp_path, engine):
    """Micro-batches packed under a token budget (their number differs between the ranks and is evened out with
    zero-weight rows, as ZeRO reduces at every micro-step) with 2 samples per prompt: the run finishes without a
    skipped step and with the same, changed weights on both ranks."""
    config, options, _ = ENGINES[engine]
    run = launch(config, tmp_path, *options, "--max-tokens-per-microbatch", "24", "--samples-per-prompt", "2")
    main = run[0]
    assert main["global_step"] == STEPS and main["counters"]["skipped/updates"] == 0
    assert main["checksum"] != main["checksum_initial"] and main["metrics_finite"]
    assert run[0]["logits_sum"] == pytest.approx(run[1]["logits_sum"], rel=1e-6)


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp2"])
def test_a_critic_free_estimator_trains_under_every_engine(tmp_path, engine):
    """RLOO (2 samples per prompt) builds no critic: the engine wraps the policy alone, which trains, the same on
    both ranks, with no skipped step."""
    config, options, _ = ENGINES[engine]
    run = launch(config, tmp_path, *options, "--estimator", "rloo", "--samples-per-prompt", "2")
    main = run[0]
    assert main["global_step"] == STEPS and main["counters"]["skipped/updates"] == 0
    assert main["checksum"]["critic"] == 0.0 and main["checksum"]["policy"] != main["checksum_initial"]["policy"]
    assert main["metrics_finite"] and all("loss/value" not in entry for entry in main["metrics"])
    assert run[0]["logits_sum"] == pytest.approx(run[1]["logits_sum"], rel=1e-6)


# ------------------------------------------------------------------------------------------------------------------
# A DeepSpeed JSON of the user's own (issue 26, item 8): explicit batch sizes, as DeepSpeed-Chat and many teams write
# them, not accelerate's "auto"; the models are loaded by the command (under ZeRO-3 inside zero.Init), not built first.
# ------------------------------------------------------------------------------------------------------------------
TINY_CPU = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"


def user_deepspeed_config(folder: Path, stage: int) -> Path:
    """A DeepSpeed JSON with every number written out (tiny_cpu.yaml's 4 prompts per micro-batch × 2 accumulation
    steps × 2 processes) and the accelerate config that points at it, as `accelerate config` writes one."""
    zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}
    deepspeed = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "wall_clock_breakdown": False,
    }
    path = folder / f"ds_zero{stage}.json"
    path.write_text(json.dumps(deepspeed, indent=2))
    config = folder / f"accelerate_zero{stage}.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        f"  deepspeed_config_file: {path}\n"
        f"  zero3_init_flag: {str(stage == 3).lower()}\n"
        f"main_process_port: {free_port()}\n"
        "num_machines: 1\n"
        "num_processes: 2\n"
        "use_cpu: true\n"
    )
    return config


@pytest.mark.parametrize(
    "stage, entry",
    [(2, "command"), (3, "command"), (3, "recipe")],
    ids=["zero2-command", "zero3-command", "zero3-recipe"],
)
def test_a_deepspeed_json_of_the_users_own(tmp_path, stage, entry):
    """`trl-ppomax ppo --accelerate_config FILE` (and the recipe under `accelerate launch`) on 2 CPU processes with a
    user's DeepSpeed JSON: the models load (under ZeRO-3 inside zero.Init, which checks train_batch_size against the
    world size: 16 = 4 × 2 × 2), train under that ZeRO stage, and the saved policy loads without DeepSpeed."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    config = user_deepspeed_config(tmp_path, stage)
    flags = ["--disable_tqdm", "True", "--eval_strategy", "no", "--save_strategy", "no"]
    if entry == "command":
        command = [sys.executable, "-m", "trl_ppomax.cli", "ppo", "--config", "tiny_cpu", "--accelerate_config"]
        command += [str(config), *flags]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        command += [str(ROOT / "recipes" / "ppo_max.py"), "--config", str(TINY_CPU), *flags]
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, failure_tail(result.stderr)
    assert "devices   : 2 × cpu (DeepSpeed), fp32" in result.stdout  # the plan: 2 processes under DeepSpeed
    assert "'objective/kl'" in result.stdout  # trained
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "output" / "ppo-max-tiny", output_loading_info=True)
    assert model.config.model_type == "llama" and not info["missing_keys"]  # whole weights, gathered from ZeRO-3
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny" / "sft", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # the tiny models, built whole on first use


def test_the_reward_command_with_a_deepspeed_json_of_the_users_own_under_zero3(tmp_path):
    """`trl-ppomax reward` with the imitation loss under ZeRO-3 and a user's DeepSpeed JSON: the causal LM is loaded
    inside zero.Init (partitioned), the reward model is built around it, trains, and saves whole."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForSequenceClassification

    config = user_deepspeed_config(tmp_path, 3)
    command = [sys.executable, "-m", "trl_ppomax.cli", "reward", "--config", "reward_tiny_cpu", "--accelerate_config"]
    command += [str(config), "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
    command += ["--num_train_epochs", "1", "--disable_tqdm", "True"]
    result = subprocess.run(
        command, cwd=tmp_path, env={**ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, failure_tail(result.stderr)
    folder = tmp_path / "output" / "reward-tiny"
    model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and model.config.num_labels == 1
    assert model.score.weight.shape == (1, model.config.hidden_size)


# ------------------------------------------------------------------------------------------------------------------
# ZeRO-3 with a DeepSpeed JSON that does not gather the weights on save (issue 31, item 4): as transformers' Trainer,
# the checkpoints and save_model hold the engine's sharded checkpoint, and the work is never lost.
# ------------------------------------------------------------------------------------------------------------------
#: What save_model's warning must tell: DeepSpeed's converters and the line that makes plain folders next time.
CONSOLIDATION_ADVICE = (
    "zero_to_fp32.py",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "trl-ppomax consolidate",
    "consolidate_engine_checkpoint",
    '"stage3_gather_16bit_weights_on_model_save": true under "zero_optimization"',
)


def non_gathering_zero3_config(folder: Path) -> Path:
    """A DeepSpeed JSON as a user writes one, with "auto" sizes and no stage3_gather_16bit_weights_on_model_save
    (so false), and the accelerate config that points at it."""
    deepspeed = {
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
    }
    path = folder / "ds_zero3.json"
    path.write_text(json.dumps(deepspeed, indent=2))
    config = folder / "accelerate_zero3.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        f"  deepspeed_config_file: {path}\n"
        "  zero3_init_flag: false\n"
        "num_machines: 1\n"
        "num_processes: 2\n"
        "use_cpu: true\n"
    )
    return config


@pytest.fixture(scope="module")
def engine_only(tmp_path_factory):
    """A run under that config stopped after iteration 2 (checkpoint-2, pushing to an intercepted Hub with
    hub_strategy="checkpoint"), then resumed to iteration 4; each saves the policy to ``policy/``."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("zero3-engine-only")
    config = non_gathering_zero3_config(root)
    output = root / "run"
    try:
        stopped, stopped_log = launch_logged(config, output, *COMMON, "--stop-at", "2", "--push-offline")
        policy = {p.relative_to(output).as_posix() for p in (output / "policy").rglob("*")}
        resumed, resumed_log = launch_logged(config, output, *COMMON, "--resume")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        pytest.fail(str(error), pytrace=False)
    return SimpleNamespace(
        dir=output,
        stopped=stopped,
        stopped_log=stopped_log,
        policy_after_stop=policy,
        resumed=resumed,
        resumed_log=resumed_log,
    )


def test_zero3_without_gathering_checkpoints_the_engine_and_warns_at_the_start(engine_only):
    stopped, main = engine_only.stopped, engine_only.stopped[0]
    assert [r["engine"] for r in stopped] == ["deepspeed-zero3"] * 2 and main["engine_checkpoint_only"]
    assert main["global_step"] == 2 and len(main["metrics"]) == 2 and main["metrics_finite"]
    assert main["checksum"]["policy"] != main["checksum_initial"]["policy"]  # trained
    checkpoint = engine_only.dir / "checkpoint-2"
    (engine,) = checkpoint.glob("global_step*")  # the engine's checkpoint holds the weights and optimizer states
    assert (checkpoint / "latest").read_text().strip() == engine.name
    assert len(list(engine.glob("*model_states.pt"))) == len(list(engine.glob("*optim_states.pt"))) == 2
    for name in ("zero_to_fp32.py", "config.json", "critic/config.json", "tokenizer.json", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name
    for name in ("ppo_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (checkpoint / name).is_file(), name
    assert not list(checkpoint.glob("*.safetensors")) and not list(checkpoint.glob("critic/*.safetensors"))
    assert not list(engine_only.dir.glob(".tmp-*"))  # written atomically, nothing left behind
    log = engine_only.stopped_log
    assert log.count("every checkpoint-N and save_model will hold DeepSpeed's sharded engine checkpoint") == 1
    assert "Cannot get 16bit model weights" not in log


def test_zero3_without_gathering_saves_the_engine_checkpoint_and_says_how_to_consolidate(engine_only):
    files = engine_only.policy_after_stop
    for name in ("policy/latest", "policy/zero_to_fp32.py", "policy/config.json", "policy/tokenizer.json"):
        assert name in files, name
    assert any(name.startswith("policy/global_step") and name.endswith("optim_states.pt") for name in files)
    assert not any(name.endswith((".safetensors", "pytorch_model.bin")) for name in files)  # no bogus weights
    warning = next(line for line in engine_only.stopped_log.splitlines() if line.startswith("save_model: "))
    assert str(engine_only.dir / "policy") in warning
    for text in CONSOLIDATION_ADVICE:
        assert text in warning, text


def test_zero3_without_gathering_pushes_no_model_but_the_checkpoint(engine_only):
    """hub_strategy="checkpoint": checkpoint-2 goes to last-checkpoint (the engine folder with it); no plain model
    exists to push, during training or at the end (push_to_hub warns and uploads nothing)."""
    pushes = engine_only.stopped[0]["pushes"]
    assert [push["path_in_repo"] for push in pushes] == ["last-checkpoint"]
    assert any(name.startswith("global_step") for name in pushes[0]["files"])
    assert "push_to_hub: not pushing" in engine_only.stopped_log and "trl-ppomax push" in engine_only.stopped_log


def test_zero3_without_gathering_resumes_from_the_engine_checkpoint(engine_only):
    stopped, resumed = engine_only.stopped[0], engine_only.resumed[0]
    assert resumed["global_step"] == STEPS and engine_only.resumed[1]["global_step"] == STEPS
    # the checkpoint's weights came back, then iterations 3 and 4 trained them further
    assert resumed["checksum_at_train_begin"] == pytest.approx(stopped["checksum"], rel=1e-12)
    assert resumed["checksum"]["policy"] != stopped["checksum"]["policy"]
    assert resumed["checksum"]["critic"] != stopped["checksum"]["critic"]
    assert len(resumed["metrics"]) == STEPS and resumed["metrics_finite"]
    assert resumed["moments"]["count"] == 16 * STEPS and resumed["moments"] == engine_only.resumed[1]["moments"]
    assert (engine_only.dir / "checkpoint-4" / "latest").is_file()
    assert [p.name for p in (engine_only.dir / "policy").glob("global_step*")] == ["global_step8"]  # the newest only


def test_zero3_engine_checkpoint_consolidates_into_a_loadable_model(engine_only, tmp_path):
    """The routes the warning names: DeepSpeed's converter gives a state dict (policy entries under `policy.`) that
    loads into the tiny model, and consolidate_engine_checkpoint a plain folder; both hold the trained weights."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from trl_ppomax.models import sub_state_dict
    from trl_ppomax.ppo.engine_checkpoint import consolidate_engine_checkpoint

    main, folder = engine_only.resumed[0], engine_only.dir / "policy"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(main["fixed_input"], return_tensors="pt")["input_ids"]

    def check(model):
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert torch.allclose(logits, torch.tensor(main["logits"]), atol=1e-5, rtol=1e-5)
        total = sum(t.double().sum().item() for t in model.state_dict().values())
        assert total == pytest.approx(main["checksum"]["policy"], rel=1e-9)

    convert_zero_checkpoint_to_fp32_state_dict(str(folder), str(tmp_path / "fp32"))
    state = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.load_state_dict(sub_state_dict(state, "policy."), strict=True)
    check(model)

    from trl_ppomax.cli import main as cli

    plain = tmp_path / "plain"  # the command the warnings name, then the function it runs
    assert cli(["consolidate", str(engine_only.dir / "checkpoint-4"), "--output", str(plain)]) == 0
    assert consolidate_engine_checkpoint(engine_only.dir / "checkpoint-4", tmp_path / "again") == tmp_path / "again"
    model, info = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    check(model)
    critic, info = AutoModelForSequenceClassification.from_pretrained(plain / "critic", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    total = sum(t.double().sum().item() for t in critic.state_dict().values())
    assert total == pytest.approx(main["checksum"]["critic"], rel=1e-9)


def test_zero3_consolidated_save_model_folder_gives_a_value_model_that_warm_starts_a_run(engine_only, tmp_path):
    """Issue 43: save_model's value_model/ held only a config; consolidating the folder (in place, as
    `trl-ppomax consolidate DIR` does) writes the trained critic there with the tokenizer: it loads with
    AutoModelForSequenceClassification holding the engine's final critic weights, and value_model= warm-starts a run."""
    from helpers import SMOKE, make_trainer
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trl_ppomax.cli import main as cli

    folder = tmp_path / "policy"
    shutil.copytree(engine_only.dir / "policy", folder)
    assert (folder / "value_model" / "config.json").is_file()
    assert not list((folder / "value_model").glob("*.safetensors"))  # the engine checkpoint holds its weights
    assert cli(["consolidate", str(folder)]) == 0
    critic, info = AutoModelForSequenceClassification.from_pretrained(
        folder / "value_model", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    engine = torch.load(engine_only.dir / "engine_critic.pt", weights_only=True)  # gathered from the engine
    consolidated = critic.state_dict()
    assert engine and set(engine) <= set(consolidated)
    for name, weight in engine.items():
        torch.testing.assert_close(consolidated[name], weight.float(), msg=name)
    tokenizer = AutoTokenizer.from_pretrained(folder / "value_model")
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(folder).get_vocab()

    warm = make_trainer(tmp_path, value_model=str(folder / "value_model"), base=SMOKE)
    started = warm.accelerator.unwrap_model(warm.model).critic.state_dict()
    for name, weight in consolidated.items():
        torch.testing.assert_close(started[name], weight, msg=name)
    warm.train()
    assert warm.state.global_step == 2
