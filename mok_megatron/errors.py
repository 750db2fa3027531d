"""The layer's error type, on the bottom floor so every module that validates input can raise it.

``MoKConfigError`` is a ``ValueError`` whose message names the value, the constraint and the fix; it is
raised when a layer is built or a command starts, before any collective runs. (``MoKOptionsError``, for a
bad ``--mok-*`` option, lives beside the options it checks.)
"""


class MoKConfigError(ValueError):
    """A setting the MoK layer cannot run with. The message names the value and the fix."""
