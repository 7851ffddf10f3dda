"""A framework's driver on its own Python and Ray: one trainer rank (an FSDP2 model over a
1-rank gloo group), one SGLang and one vLLM engine started by weightsync in envs built for this
interpreter's pair, two verified syncs into both, greedy tokens from both after each.

    python pair_driver.py MODEL_DIR      # prints one line: PAIR-RESULT {json}

Run by tests/envs/test_host_pairs.py with a driver venv's interpreter, from outside the checkout.
"""

from __future__ import annotations

import json
import socket
import sys

import ray
import torch

import weightsync
from weightsync.apps.models import make_tiny_model
from weightsync.driver import envs


def main(model_dir: str) -> None:
    model_path = make_tiny_model(model_dir, arch="gpt2", seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    weightsync.init_trainer_group(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    from transformers import AutoModelForCausalLM

    model = weightsync.shard_model(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    )
    sync = weightsync.TrainerSync(
        model, options=weightsync.SyncOptions(transport="shm", verify=True)
    )
    weightsync.init_ray(num_cpus=2)
    engines = {
        "sglang": weightsync.launch("weightsync.backends.sglang.engine.SglEngineActor", model_path),
        "vllm": weightsync.launch("weightsync.backends.vllm.engine.VllmEngineActor", model_path),
    }
    sync.connect(engines)
    out: dict = {
        "pair": str(envs.host_pair()),
        "package": weightsync.__file__,
        "installed": envs.INSTALLED,
        "driver_python": sys.executable,
        "ray": ray.__version__,
        "engines": {},
        "syncs": [],
    }
    for name, engine in engines.items():
        where = ray.get(engine.handle.where.remote())
        out["engines"][name] = {"python": where["python"], "env_python": ""}
    out["engines"]["sglang"]["env_python"] = str(envs.python_path("sglang"))
    out["engines"]["vllm"]["env_python"] = str(envs.python_path(envs.default_vllm_env()))
    prompt = [[2, 100, 200, 300]]
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        report = sync.sync(f"step-{step}")
        assert report is not None and report.verify is not None
        tokens = {
            name: ray.get(engine.generate.remote(prompt, max_new_tokens=6))["tokens"][0]
            for name, engine in engines.items()
        }
        out["syncs"].append(
            {
                "version": report.version,
                "path": report.path,
                "verified": {n: bool(v.verified) for n, v in report.verify.engines.items()},
                "tokens": tokens,
            }
        )
    sync.close()
    print("PAIR-RESULT " + json.dumps(out), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
