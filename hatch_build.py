"""Wheel build hook: ship each env's definition (envs/<name>/pyproject.toml and uv.lock) inside
the package, as weightsync/env_definitions/<name>/, where weightsync/driver/envs.py finds it when
weightsync runs from an installed wheel. Editable installs read the checkout's envs/ instead."""

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class EnvDefinitionsHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if version == "editable":
            return
        for definition in sorted(Path(self.root, "envs").glob("*/pyproject.toml")):
            for name in ("pyproject.toml", "uv.lock"):
                source = definition.parent / name
                target = f"weightsync/env_definitions/{definition.parent.name}/{name}"
                build_data["force_include"][str(source)] = target
