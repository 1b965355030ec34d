"""The errors flowattn raises on purpose: one base class, a few kinds.

Every error the library raises deliberately derives from :class:`FlowattnError`, so a caller
(the command line among them) can tell "the library refused this, with a reason" from a bug
with one ``except`` clause. The kinds also derive from the built-in exception a Python user
would expect (``ValueError`` for a refused value, ``RuntimeError`` for a computation or run that
cannot go on), so ``except ValueError`` keeps working.

====================  =====================================================================
kind                  raised when
====================  =====================================================================
InputError            an argument, tensor or setting is refused (shape, range, type)
ConfigError           a run setting is refused; the message names the key and the value
DataError             a data file or data set cannot be used
NonFiniteError        an input or activation holds NaN or Inf
RunError              a run folder, checkpoint or resume request cannot be honoured
CheckpointError       a checkpoint file is missing, torn, foreign or of another version
InverseNotConverged   a fixed-point or Newton inverse did not reach its tolerance
ODESolverError        the ODE solver of a continuous flow failed
====================  =====================================================================

Examples:
    >>> from flowattn.errors import ConfigError, FlowattnError
    >>> try:
    ...     raise ConfigError("steps must be a positive integer, got -3")
    ... except FlowattnError as err:
    ...     print(type(err).__name__, err.exit_code)
    ConfigError 2
"""

from __future__ import annotations

__all__ = [
    "FlowattnError",
    "InputError",
    "ConfigError",
    "DataError",
    "NonFiniteError",
    "RunError",
    "CheckpointError",
    "InverseNotConverged",
    "ODESolverError",
]


class FlowattnError(Exception):
    """Base class of every error flowattn raises on purpose.

    ``exit_code`` is the status the command line exits with when it reports the error, and
    :meth:`line` the message it prints.
    """

    exit_code: int = 2

    def line(self) -> str:
        """The message on one line (its line breaks as spaces), as a command reports it."""
        return " ".join(str(self).split("\n"))


class InputError(FlowattnError, ValueError):
    """An argument, tensor or setting that the library refuses, with the reason."""


class ConfigError(InputError):
    """A run setting that is refused: the message names the key and the offending value."""


class DataError(InputError):
    """A data file or built-in data set that cannot be used."""


class NonFiniteError(InputError):
    """An input or intermediate value that holds NaN or Inf."""


class RunError(FlowattnError, RuntimeError):
    """A run that cannot start or continue (output folder, resume request, divergence)."""


class CheckpointError(RunError):
    """A checkpoint that is missing, empty, torn, foreign or written by another version."""


class InverseNotConverged(FlowattnError, RuntimeError):
    """The inverse of a residual block (fixed-point, Anderson or Newton) did not reach its
    tolerance.

    Attributes:
        residual: the worst residual max_i |x_i + g(x)_i - y_i| (over the unconverged sets),
            relative to max(1, max |y|) as in the convergence test.
        iterations: the number of iterations run.
        unconverged: how many sets of the batch did not converge.
        tol: the tolerance that was asked for.
    """

    def __init__(self, residual: float, iterations: int, unconverged: int, tol: float) -> None:
        self.residual = residual
        self.iterations = iterations
        self.unconverged = unconverged
        self.tol = tol
        super().__init__(
            f"inverse did not converge: {unconverged} set(s) still have relative residual up to "
            f"{residual:.3e} > tol={tol:.1e} after {iterations} iterations (is the branch "
            "contractive? raise InverseOptions.max_iter or .tol, or use Anderson acceleration)"
        )

    def __reduce__(self):  # picklable across processes despite the custom signature
        return (type(self), (self.residual, self.iterations, self.unconverged, self.tol))


class ODESolverError(FlowattnError, RuntimeError):
    """The ODE solve of a continuous flow failed. ``cause`` names why, one of:

    * ``"step size underflow"``: the adaptive step shrank below the resolution of t (the field
      is too stiff, or the solution blows up, at the reported time);
    * ``"non-finite state"``: the state became NaN or Inf;
    * ``"non-finite vector field"``: the field returned NaN or Inf;
    * ``"too many steps"``: the solve needed more than ``max_steps`` steps;
    * ``"solver assertion"``: any other internal check of torchdiffeq failed (message kept).
    """

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause

    def __reduce__(self):
        return (type(self), (str(self), self.cause))
