"""How `det e create` names its config file and context directory, in Determined's spellings
(`CONFIG CONTEXT`, `--config-file CONFIG CONTEXT`, `--template`): shared by the local command and
remote mode's upload (cli/remote/transfer.py), so it imports nothing else of the CLI."""

from __future__ import annotations

from pathlib import Path

import click

NO_CONTEXT = (
    "missing the context directory (the code the trials run): "
    "det e create {config} CONTEXT_DIR; pass `.` for the current directory"
)


def config_and_context(
    config_file: Path | None, context_dir: Path | None, config_opt: Path | None, template: str | None
) -> tuple[Path, Path]:
    """Determined's spellings -> (config, context); a clear usage error for what cannot be.
    Also what remote mode's create uploads."""
    if template is not None:
        raise click.UsageError(
            f"--template {template}: config templates are not supported (they live on Determined's master); "
            "merge the template into the config file or give its values with --config KEY=VALUE"
        )
    if config_opt is not None:
        if config_file is not None and context_dir is not None:
            raise click.UsageError("--config-file is given, so only one argument (the context directory) is expected")
        # With --config-file the single positional word is the context directory.
        config_file, context_dir = config_opt, config_file
        if context_dir is None:
            raise click.UsageError(NO_CONTEXT.format(config=f"--config-file {config_opt}"))
        return config_file, context_dir
    if config_file is None:
        raise click.UsageError("missing the experiment config: det e create CONFIG_FILE CONTEXT_DIR")
    if context_dir is None:
        raise click.UsageError(NO_CONTEXT.format(config=config_file))
    return config_file, context_dir
