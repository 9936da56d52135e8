"""One small exception hierarchy. Each error builds its message from fields it keeps."""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: detslurm/__init__ imports this module at every interpreter start
if TYPE_CHECKING:
    from collections.abc import Sequence


class DetSlurmError(Exception):
    """Base of every error the CLI turns into a clean message and an exit code."""

    exit_code = 1


# The root every experiment-config error path starts from where no file is known (a dict given
# to the SDK, a stored row): Determined's own spelling, "<config>.searcher.metric: ...".
CONFIG_ROOT = "<config>"


class ConfigError(DetSlurmError):
    """An experiment or site config is invalid; ``errors`` holds one line per problem."""

    def __init__(self, errors: Sequence[str], source: str = "experiment configuration") -> None:
        self.errors = list(errors)
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        body = "\n".join(f"  {e}" for e in self.errors)
        return f"invalid {self.source}:\n{body}"

    def in_file(self, name: str) -> ConfigError:
        """The same error told against the user's file: ``<config>.searcher.metric: ...`` reads
        ``NAME: searcher.metric: ...``. Changed in place (class and exit code stay); returned
        for ``raise e.in_file(name)``."""
        self.errors = [_in_file(line, name) for line in self.errors]
        self.args = (self._message(),)
        return self


def _in_file(line: str, name: str) -> str:
    if line.startswith(CONFIG_ROOT + "."):
        return f"{name}: {line[len(CONFIG_ROOT) + 1 :]}"
    if line.startswith(CONFIG_ROOT):
        return name + line[len(CONFIG_ROOT) :]
    return line


class ContextError(DetSlurmError):
    """The context directory cannot be packaged or extracted safely."""


class StoreError(DetSlurmError):
    """The state store cannot be opened or is inconsistent."""


class NotFoundError(DetSlurmError):
    def __init__(self, kind: str, ident: object) -> None:
        self.kind = kind
        self.ident = ident
        super().__init__(f"{kind} {ident} not found")


class StateError(DetSlurmError):
    """An operation is not valid in the object's current state."""


class CheckpointNotFound(DetSlurmError):
    def __init__(self, uuid: str, where: str) -> None:
        self.uuid = uuid
        super().__init__(f"checkpoint {uuid} not found in {where}")


class InvalidHP(Exception):
    """Raised by user code to tell the searcher that these hyperparameters are unusable.

    Not a DetSlurmError: it is a signal from the trial, handled by ``core.init().__exit__``.
    """

    def __init__(self, msg: str = "...") -> None:
        # Determined's constructor: one optional message, a string (anything else is a mistake
        # that would surface later as an unreadable searcher note).
        if not isinstance(msg, str):
            raise TypeError(f"InvalidHP takes a message string, not {type(msg).__name__}")
        # Exception's args stay what the caller passed, as in Determined: str(InvalidHP()) is "".
        self.msg = msg
