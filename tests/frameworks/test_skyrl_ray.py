"""weightplan.adapters.skyrl reaches SkyRL's Ray workers through Ray's RAY_RUNTIME_ENV_HOOK alone: the driver's settings
go with it, and a hook or settings it cannot honour are refused in one line."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from weightplan.adapters import skyrl as adapter


def test_the_hook_names_the_worker_setup_and_carries_the_drivers_settings(monkeypatch):
    monkeypatch.setattr(adapter, "_settings", adapter.WeightplanSettings(job="driver", timeout=33.0, workdir="/shared"))
    monkeypatch.setattr(adapter, "install", lambda settings=None: None)  # install() itself: test_skyrl.py
    env = adapter.ray_runtime_env({"env_vars": {"SKYRL_LOG_FILE": "/tmp/x"}})
    assert env["worker_process_setup_hook"] == adapter.WORKER_HOOK == "weightplan.adapters.skyrl.install_in_worker"
    assert env["env_vars"]["SKYRL_LOG_FILE"] == "/tmp/x"
    assert adapter.WeightplanSettings.from_json(env["env_vars"][adapter.SETTINGS_ENV], adapter.SETTINGS_ENV) == adapter._settings
    assert adapter.ray_runtime_env(None)["worker_process_setup_hook"] == adapter.WORKER_HOOK
    assert adapter.SETTINGS_ENV in adapter.ray_runtime_env({"env_vars": None})["env_vars"]
    with pytest.raises(ValueError) as refused:
        adapter.ray_runtime_env({"worker_process_setup_hook": "mylab.setup"})
    assert str(refused.value) == ("weightplan's SkyRL adapter sets Ray's worker_process_setup_hook, which this job's "
                                  "runtime env already sets to 'mylab.setup': call weightplan.adapters.skyrl.install() "
                                  "from that hook instead")


@pytest.mark.parametrize("text, line", [
    ("[1]", "WEIGHTPLAN_SKYRL_SETTINGS is not a JSON object of WeightplanSettings fields: '[1]'"),
    ("{job: 1}", "WEIGHTPLAN_SKYRL_SETTINGS is not a JSON object of WeightplanSettings fields: '{job: 1}'"),
    ('{"jobb": "x"}', "WEIGHTPLAN_SKYRL_SETTINGS names jobb, which WeightplanSettings does not have"),
    ('{"timeout": "5"}', "WEIGHTPLAN_SKYRL_SETTINGS: timeout='5' has the wrong type"),
    ('{"verify": 1, "delta": true}', "WEIGHTPLAN_SKYRL_SETTINGS: delta=True, verify=1 has the wrong type"),
    ('{"plan": 7}', "WEIGHTPLAN_SKYRL_SETTINGS: plan=7 has the wrong type"),
])
def test_settings_a_worker_cannot_read_are_refused_in_one_line(text, line):
    with pytest.raises(ValueError) as refused:
        adapter.WeightplanSettings.from_json(text, adapter.SETTINGS_ENV)
    assert str(refused.value) == line


def test_settings_round_trip_through_json():
    settings = adapter.WeightplanSettings(plan="/p.plan", address="10.0.0.1:29500", job="j", timeout=5, verify=True,
                                          delta=0.25, workdir=None)
    assert adapter.WeightplanSettings.from_json(json.dumps(asdict(settings)), adapter.SETTINGS_ENV) == settings
    assert adapter.WeightplanSettings.from_json("{}", adapter.SETTINGS_ENV) == adapter.WeightplanSettings()


def test_skyrl_initialize_ray_with_the_hook_installs_in_the_driver_and_in_every_worker(tmp_path, monkeypatch):
    """SkyRL's own `initialize_ray` (its `ray.init(runtime_env={"env_vars": ...})`) on a real local Ray, the driver run
    with RAY_RUNTIME_ENV_HOOK and nothing else: the driver installed, and an actor (as SkyRL's policy workers), and one
    with a runtime env of its own (as SkyRL's engine actors get), resolve "weightplan" and hold the driver's settings."""
    pytest.importorskip("skyrl", reason="SkyRL is installed only in the vLLM 0.30 venv (make test-compat VLLM=0.30.0)")
    ray = pytest.importorskip("ray")
    from skyrl.train.config.config import SkyRLTrainConfig
    from skyrl.train.utils.utils import initialize_ray

    for name in ("RAY_BACKEND_LOG_LEVEL", "SKYRL_LOG_FILE"):  # initialize_ray sets them in this process
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("RAY_RUNTIME_ENV_HOOK", adapter.RAY_HOOK)
    adapter.uninstall()
    driver = adapter.WeightplanSettings(job="from-the-driver", timeout=33.0, workdir=str(tmp_path / "shared"))
    monkeypatch.setattr(adapter, "_settings", driver)
    cfg = SkyRLTrainConfig()
    cfg.trainer.log_path = str(tmp_path / "logs")

    @ray.remote(num_cpus=0)
    class Probe:
        def ask(self):
            from dataclasses import asdict

            from skyrl.backends.skyrl_train import weight_sync

            from weightplan.adapters import skyrl

            return (skyrl.installed(), weight_sync.get_transfer_strategy("weightplan", False),
                    weight_sync.get_vllm_receive_backend("weightplan", False), asdict(skyrl._settings))

    try:
        initialize_ray(cfg)
        assert adapter.installed()
        expected = (True, "weightplan", "weightplan", asdict(driver))
        assert ray.get(Probe.remote().ask.remote(), timeout=180) == expected
        own_env = Probe.options(runtime_env={"env_vars": {"VLLM_USE_V1": "1"}}).remote()
        assert ray.get(own_env.ask.remote(), timeout=180) == expected
    finally:
        ray.shutdown()
        adapter.uninstall()
