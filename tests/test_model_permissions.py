"""Model files another user can read: safetensors writes 0600, so what zerotuner writes for
others (the demo model, exports, adapters) gets the read bits the umask allows, and a model the
run's user cannot read is one line before any rank starts (the image runs as uid 1000)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from zerotuner.errors import ConfigError
from zerotuner.preflight.steps import resolve_model
from zerotuner.settings.folders import readable_by_all
from zerotuner.settings.schema import Settings

NOBODY = 65534


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*")}


def test_the_demo_model_is_readable_by_every_user(demo_dir: Path) -> None:
    weights = list((demo_dir / "model").rglob("*.safetensors"))
    assert weights and all(p.stat().st_mode & 0o444 == 0o444 for p in weights)


def test_readable_by_all_adds_only_what_the_umask_allows(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    (tmp_path / "part").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "part" / "w.safetensors"))
    assert _modes(tmp_path)["part/w.safetensors"] == 0o600  # what safetensors writes
    old = os.umask(0o027)
    try:
        readable_by_all(tmp_path)
    finally:
        os.umask(old)
    assert _modes(tmp_path)["part/w.safetensors"] == 0o640
    readable_by_all(tmp_path)  # umask 022
    assert _modes(tmp_path)["part/w.safetensors"] == 0o644


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_a_model_the_user_cannot_read_is_one_line(demo_dir: Path) -> None:
    """As uid 65534 (a forked child, so the check is the kernel's), a weights file of mode 0600
    owned by root is named in one ConfigError; readable again, the model resolves."""
    root = Path(tempfile.mkdtemp(prefix="zt-perm-"))  # pytest's own tmp is root's alone
    root.chmod(0o755)
    model = root / "model"
    shutil.copytree(demo_dir / "model", model)
    try:
        _refused_then_resolved(model)
    finally:
        shutil.rmtree(root)


def _refused_then_resolved(model: Path) -> None:
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    weights.chmod(0o600)
    settings = Settings(model=str(model))

    def as_nobody() -> str:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # never back into pytest: whatever happens, the child ends here
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                try:
                    answer = f"ok {resolve_model(settings).family}"
                except ConfigError as error:
                    answer = f"error {error}"
                except BaseException as error:  # noqa: BLE001 - reported to the parent
                    answer = f"raised {error!r}"
                os.write(write, answer.encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            answer = pipe.read()
        os.waitpid(child, 0)
        return answer

    answer = as_nobody()
    assert answer.startswith("error ZT_MODEL=") and "\n" not in answer
    assert f"{weights} cannot be read by uid {NOBODY}" in answer and "chmod -R a+rX" in answer
    weights.chmod(0o644)
    assert as_nobody() == "ok sdxl"
