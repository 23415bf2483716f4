"""What the user asked for, read one way by every command, the builder and the ranks.

The effective settings are: the `ZT_*` variables (no unknown name that looks like a typo), the
config file and secrets, then the DeepSpeed and accelerate files they name, whose launch
values and `nvme_path` fill what the user left unset (`inputs.apply_implied_settings`), then the
folders checked against each other. `train`, `config`, `plan`, `check` and the config builder
all begin here, so a refusal added to these steps reaches each of them; `check` reports the
steps one by one (`SettingsPath.STEPS`), the others run them at once (`effective_settings`).

Nothing here imports torch: `train` calls it before its ranks start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zerotuner.errors import ConfigError
from zerotuner.settings.folders import refuse_overlaps
from zerotuner.settings.inputs import UserInputs, apply_implied_settings, read_user_inputs
from zerotuner.settings.schema import Settings, load_settings, unknown_env_names

log = logging.getLogger(__name__)

TRUE_WORDS = ("1", "true", "yes", "on")  # as huggingface_hub reads its flags


@dataclass(frozen=True)
class Effective:
    settings: Settings  # with what the user's files imply filled in
    inputs: UserInputs  # the DeepSpeed/accelerate files, read
    hub_offline: bool = False  # HF_HUB_OFFLINE in these variables: no hub request at all


def check_unknown_env(environ: Mapping[str, str] | None = None, *, warn: bool = True) -> None:
    """pydantic-settings ignores unknown ZT_* names; a near miss of a real one is a typo
    (exit 2), anything else (Kubernetes' `ZT_SERVICE_HOST` for a Service called `zt`) a
    warning, unless `warn` is off (the ranks: their entrypoint warned already)."""
    typos = []
    for name, hint, is_typo in unknown_env_names(environ):
        if is_typo:
            typos.append(f"{name}: unknown setting{hint}")
        elif warn:
            log.warning("%s is not a zerotuner setting and is ignored%s", name, hint)
    if typos:
        raise ConfigError("unknown settings", problems=typos)


class SettingsPath:
    """The steps from variables to effective settings, in order; each returns what it found,
    in words (what `check` prints), and raises ConfigError with the line every command shows.

    `environ`: the variables to read (default: the process's); `overrides`: settings given by
    flags (`plan --resolution`, the what-if `--nodes`); `settings`: already loaded (a caller
    that built them in code: the bench, tests), so the first step only takes them."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        warn: bool = True,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> None:
        self.environ = os.environ if environ is None else environ
        self.warn = warn
        self.overrides = overrides
        self.settings: Settings | None = settings
        self.inputs: UserInputs | None = None

    def read_settings(self) -> str:
        if self.settings is None:
            check_unknown_env(self.environ, warn=self.warn)
            self.settings = load_settings(self.environ, **self.overrides)
        path = self.settings.config_file
        return f"loaded (config file {path})" if path.exists() else "loaded (no config file)"

    def read_files(self) -> str:
        assert self.settings is not None
        inputs = read_user_inputs(self.settings)
        # Before anything uses a folder: a real nvme_path in the user's files is the offload
        # dir the metrics watch, the device is mounted at, and preflight plans and checks.
        self.settings = apply_implied_settings(self.settings, inputs)
        self.inputs = inputs
        detail = f"DeepSpeed/accelerate input: {inputs.source or 'none (built from settings)'}"
        if inputs.nvme is not None:
            detail += f"; NVMe offload folder {self.settings.offload_dir} (its nvme_path)"
        return detail

    def check_folders(self) -> str:
        assert self.settings is not None
        return refuse_overlaps(self.settings)  # before a scan, a mount or a write touches one

    STEPS: tuple[tuple[str, Callable[[SettingsPath], str]], ...] = (
        ("settings", read_settings),
        ("config files", read_files),
        ("folders", check_folders),
    )

    def run(self) -> Effective:
        for _, step in self.STEPS:
            step(self)
        return self.effective()

    def effective(self) -> Effective:
        """What the steps found (once the settings and files have read)."""
        assert self.settings is not None and self.inputs is not None
        offline = self.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE_WORDS
        return Effective(self.settings, self.inputs, hub_offline=offline)


def effective_settings(
    environ: Mapping[str, str] | None = None,
    *,
    warn: bool = True,
    settings: Settings | None = None,
    **overrides: Any,
) -> Effective:
    """Every step of `SettingsPath`, at once: what `train`, `config`, `plan`, the builder and
    the ranks start from."""
    return SettingsPath(environ, warn=warn, settings=settings, **overrides).run()
