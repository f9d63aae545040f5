"""Careless and hostile inputs to the compiler and verify-plan: one clear error naming the option or field, before any tracing."""

from __future__ import annotations

import json

import pytest

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import PlanMismatchError
from weightplan.runtime.transport import protocol

from ..conftest import config_dir


@pytest.mark.parametrize("trainer,inference,message", [
    ("fsdp=1", "tp=²", r"bad --inference item 'tp=²'"),
    ("fsdp=1", "tp=1,tp=2", "--inference 'tp=1,tp=2' gives tp twice"),
    ("fsdp=2,fsdp=4", "tp=1", "--trainer 'fsdp=2,fsdp=4' gives fsdp twice"),
    ("", "tp=1", "--trainer is empty"),
    ("fsdp=1", " ", "--inference is empty"),
    ("fsdp=1", "dp=100000", r"bad --inference item 'dp=100000'.*1\.\.4096"),
    ("fsdp=1000000", "tp=1", r"bad --trainer item 'fsdp=1000000'"),
    ("fsdp=4096,replicas=2", "tp=1", "8192 ranks; plans support at most 4096"),
    ("fsdp=1", "tp=64,dp=128", "8192 ranks; plans support at most 4096"),
    ("fsdp=2,", "tp=1", "bad --trainer item ''"),
])
def test_layout_strings_are_refused_before_tracing(tmp_path, trainer, inference, message):
    out = tmp_path / "never.plan"
    with pytest.raises(ModelConfigError, match=message):
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=out, trainer=trainer, inference=inference))
    assert not out.exists()


def test_trainer_ep_beyond_the_expert_count_is_refused(tmp_path):
    experts = json.loads((config_dir("tiny-glm") / "config.json").read_text())["n_routed_experts"]
    with pytest.raises(ModelConfigError, match=f"--trainer ep={4 * experts} is more than the model's {experts} routed experts"):
        compile_plan(CompileOptions(str(config_dir("tiny-glm")), "stacked", output=tmp_path / "p.plan",
                                    trainer=f"fsdp={4 * experts},ep={4 * experts}"))


@pytest.mark.parametrize("content,message", [
    (b"[1, 2]", "holds a JSON list, expected an object"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b"{", "is not valid JSON"),
    (json.dumps({"num_attention_heads": "8"}).encode(), "field 'num_attention_heads' is '8', expected an integer in 0..65536"),
    (b"[" * 100000, "is not valid JSON"),
])
def test_malformed_config_json_names_the_file_and_field(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ModelConfigError, match=message) as info:
        compile_plan(CompileOptions(str(tmp_path), output=tmp_path / "p.plan"))
    assert str(tmp_path / "config.json") in str(info.value) and "\n" not in str(info.value)


def test_verify_refuses_a_sample_with_nothing_to_compare(plan_cache):
    path = plan_cache("tiny-llama")
    with pytest.raises(PlanMismatchError, match="no destination tensor of at most 1 bytes to sample"):
        verify_plan(path, model=str(config_dir("tiny-llama")), sample=3, max_tensor_bytes=1)


# --- runtime arguments --------------------------------------------------------------------------


@pytest.fixture
def llama_plan(plan_cache):
    from weightplan.runtime import load_plan

    return load_plan(plan_cache("tiny-llama", "hf", "bf16", "fsdp=1", "tp=1"))


@pytest.mark.parametrize("rank", [0.5, True, "0", -1])
def test_sender_and_receiver_refuse_ranks_that_are_not_plan_ranks(llama_plan, rendezvous, no_agents, rank):
    from weightplan.runtime import Receiver, Sender

    from weightplan.testing.runtime_worker import full_weights, plain_destination, shard

    with pytest.raises(PlanMismatchError, match=f"trainer rank {rank!r} is not in the plan's 1 trainer ranks"):
        Sender(llama_plan, rank, shard(llama_plan, full_weights(llama_plan, 0, 1), 0), rendezvous=rendezvous)
    with pytest.raises(PlanMismatchError, match=f"inference rank {rank!r} is not in the plan's 1 inference ranks"):
        Receiver(llama_plan, rank, plain_destination(llama_plan, 0), rendezvous=rendezvous, derived="caller")


def test_aliased_destinations_are_refused_before_registering(llama_plan, rendezvous, no_agents):
    from weightplan.runtime import Receiver

    from weightplan.testing.runtime_worker import plain_destination

    destination = plain_destination(llama_plan, 0)
    first, second = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    assert destination[first].shape == destination[second].shape
    destination[second] = destination[first]
    with pytest.raises(PlanMismatchError, match="share memory"):
        Receiver(llama_plan, 0, destination, rendezvous=rendezvous, derived="caller")


@pytest.mark.parametrize("version", [1.5, 0, -3, 2**62, True, "2"])
def test_versions_are_checked_before_anything_moves(llama_plan, rendezvous, version):
    from weightplan.runtime import Receiver, Sender

    from weightplan.testing.runtime_worker import full_weights, plain_destination, shard

    sender = Sender(llama_plan, 0, shard(llama_plan, full_weights(llama_plan, 0, 1), 0), rendezvous=rendezvous, timeout=2).start()
    receiver = Receiver(llama_plan, 0, plain_destination(llama_plan, 0), rendezvous=rendezvous, timeout=2, derived="caller").start()
    for call in (sender.publish, sender.release, receiver.sync):
        with pytest.raises(ValueError, match="versions are integers from 1 to 2\\*\\*62 - 1"):
            call(version)
    assert receiver.version is None and not rendezvous.exists(protocol.version_key(0, version))


# --- plan files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("output,message", [
    ("", r"-o/--output \. is a directory"),  # Path("") is the working directory
    ("{tmp}", "is a directory"),
    ("/proc/weightplan.plan", "cannot create files under /proc"),
    ("/dev/null", "exists and is not a regular file"),
    ("{tmp}/" + "p" * 300 + ".plan", "File name too long"),
    ("{tmp}/" + "p" * 250 + ".plan", "file name is longer than"),  # fits, but the writer's temporary name would not
    ("/sys/kernel/x.plan", "cannot create files"),
])
def test_unwritable_outputs_are_refused_before_compiling(tmp_path, output, message):
    from pathlib import Path

    with pytest.raises(ModelConfigError, match=message) as info:
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=Path(output.format(tmp=tmp_path))))
    assert "\n" not in str(info.value) and not list(tmp_path.iterdir())


def test_concurrent_writers_never_show_a_reader_half_a_plan(plan_cache, tmp_path):
    import threading

    from weightplan.runtime import load_plan
    from weightplan.runtime.plan.format import write_plan

    plan = load_plan(plan_cache("tiny-llama"))
    path, errors, done = tmp_path / "shared.plan", [], threading.Event()

    def writer():
        try:
            for _ in range(30):
                write_plan(path, plan.header, plan.table, plan.stage, plan.spans)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def reader():
        while not done.is_set():
            try:
                if path.exists():
                    assert load_plan(path).fingerprint == plan.fingerprint
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(5)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.plan"]  # no temporary file left behind


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_plan_readers_refuse_files_that_are_not_regular(tmp_path, kind):
    import os

    from weightplan.runtime import load_plan
    from weightplan.runtime.errors import PlanFormatError

    path = {"fifo": tmp_path / "fifo", "device": "/dev/zero", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(PlanFormatError, match="not a regular file|Is a directory"):
        load_plan(path)
