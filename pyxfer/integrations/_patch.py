"""The one patch contract every pyxfer integration follows.

An integration replaces a few named bindings of another library (module globals, class attributes)
with pyxfer's versions, and can put back the identical original objects. Subclass ``Integration``:

    class _Gather(Integration):
        def __init__(self):
            super().__init__("transformer_engine", module="transformer_engine.pytorch",
                             distribution="transformer-engine", tested=("2.8", "2.21"))

        def bindings(self, target, **options):
            # (owner, attribute name, replacement) for every binding to replace; nothing is
            # changed until all of them have been found.
            yield target.distributed, "_all_gather_mxfp8", make_replacement(...)
            # a function other modules import by name (``from m import f``): those bindings too
            original = target.distributed.gather_along_first_dim
            replacement = make_replacement(original)
            yield target.distributed, "gather_along_first_dim", replacement
            for owner, attribute in holders(original, exclude=target.distributed):
                yield owner, attribute, replacement

    _integration = _Gather()
    patch, unpatch, patched, is_patched = (_integration.patch, _integration.unpatch,
                                           _integration.patched, _integration.is_patched)

Rules (docs/design.md, "Integrations are opt-in and reversible"):

- The target is imported lazily, on the first ``patch()`` (or ``target()``), never by ``import pyxfer``.
  A missing library, one that fails to import, or a version outside ``tested`` (lowest tested
  release inclusive, first untested release exclusive) raises ``IntegrationError``, an ImportError.
  Setting $PYXFER_ALLOW_UNTESTED=1 turns the version check into a warning.
- ``holders(obj)`` finds every loaded module that holds ``obj`` under any name, each module once
  (``__main__`` is also registered as ``__mp_main__`` once multiprocessing is imported).
- ``patch(**options)`` finds every binding first (a missing attribute raises IntegrationError and
  changes nothing), then rebinds them all and returns a ``PatchReport``: every binding found and
  changed, with its owner, attribute name, original and replacement. Idempotent: a second call with
  the same options changes nothing and returns the current report; with other options it raises
  ValueError (unpatch first).
- ``unpatch()`` puts back the identical original object of every binding (an attribute that the
  owner only inherited is deleted again, so a class falls back to its base's). If someone else
  re-bound one of them since ``patch()`` (the owner no longer holds pyxfer's replacement),
  ``unpatch()`` raises ``PatchConflictError`` naming those bindings and changes nothing;
  ``unpatch(force=True)`` restores the originals anyway and warns. Without a patch it does nothing.
- ``patched(**options)`` is a context manager around patch/unpatch; it unpatches when the body
  raises, and leaves a patch that was already applied before it was entered in place.
- patch/unpatch hold one lock per integration (safe from several threads).
"""
import contextlib
import dataclasses
import importlib
import importlib.metadata
import os
import re
import sys
import threading
import warnings

__all__ = ["Binding", "Integration", "IntegrationError", "PatchConflictError", "PatchReport", "holders"]

_ALLOW_UNTESTED = "PYXFER_ALLOW_UNTESTED"


class IntegrationError(ImportError):
    """The library an integration targets is missing, fails to import, is outside the tested
    version range, or lacks a binding the integration replaces."""


class PatchConflictError(RuntimeError):
    """unpatch() found a binding that someone else re-bound after pyxfer patched it."""


def _qualname(owner) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__


@dataclasses.dataclass(frozen=True, eq=False)
class Binding:
    """One replaced binding: ``owner.attribute`` held ``original`` and now holds ``replacement``.
    ``inherited``: the owner did not hold the attribute itself (unpatch deletes it again)."""

    owner: object
    attribute: str
    original: object
    replacement: object
    inherited: bool = False

    @property
    def where(self) -> str:
        """Readable location, e.g. ``accelerate.hooks.send_to_device``."""
        return f"{_qualname(self.owner)}.{self.attribute}"

    def current(self):
        """What the owner holds now under the attribute (its own binding; None if it holds none)."""
        return _own_attribute(self.owner, self.attribute)[1]


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What ``patch()`` changed: the integration, the target's version, the options and every binding."""

    integration: str
    target_version: str
    options: dict
    bindings: tuple

    def __str__(self) -> str:
        lines = [f"pyxfer.integrations.{self.integration} (target version {self.target_version}): "
                 f"{len(self.bindings)} binding{'s' if len(self.bindings) != 1 else ''} patched"]
        lines += [f"  {b.where}: {getattr(b.original, '__module__', '?')}."
                  f"{getattr(b.original, '__qualname__', repr(b.original))} -> pyxfer" for b in self.bindings]
        return "\n".join(lines)


def _own_attribute(owner, attribute):
    """(held by the owner itself, value): modules and classes are read through their __dict__ so
    that a staticmethod/classmethod/descriptor is kept as the object it is, not what it binds to."""
    namespace = getattr(owner, "__dict__", None)
    if namespace is not None and attribute in namespace:
        return True, namespace[attribute]
    if namespace is None and hasattr(owner, attribute):  # e.g. __slots__ instances
        return True, getattr(owner, attribute)
    return False, None


def holders(obj, exclude=None):
    """(module, attribute) of every loaded module's global that is ``obj``, under any name: the
    modules that imported it by name (``from owner import f``, ``... import f as g``). Each module
    once, though sys.modules may hold it under two names: ``import multiprocessing`` (which
    ``import torch`` does) registers ``__main__`` again as ``__mp_main__``. ``exclude``: a module
    to leave out (the owner the caller patches itself)."""
    seen = set() if exclude is None else {id(exclude)}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if id(module) in seen or not isinstance(namespace, dict):
            continue
        seen.add(id(module))
        for attribute, value in list(namespace.items()):
            if value is obj:
                yield module, attribute


def _release(version: str) -> tuple:
    """The numeric release of a version string: "1.15.0.dev0" -> (1, 15, 0), "2.20.2+cu13" -> (2, 20, 2)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(p) for p in m[1].split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()  # 1.15.0 == 1.15
    return tuple(parts)


def _below(version: str, bound: str) -> bool:
    """``version`` < ``bound``; a pre-release of the bound itself (2.0.0rc1 against 2.0) counts as
    not below it, so the first untested release stays untested in all its forms."""
    return _release(version) < _release(bound)


class Integration:
    """Base class of pyxfer's integrations (see the module docstring for the contract).

    ``name``: the integration's name (``pyxfer.integrations.<name>``). ``module``: the import name
    of the target (e.g. "accelerate", "transformer_engine.pytorch"). ``distribution``: its name on
    PyPI, for the version and the error message. ``tested``: (lowest tested version, first untested
    version), e.g. ("1.10", "1.16") means 1.10 <= version < 1.16.
    Subclasses implement ``bindings(target, **options)``.
    """

    def __init__(self, name: str, *, module: str, distribution: str, tested: tuple):
        if len(tested) != 2 or not _below(tested[0], tested[1]):
            raise ValueError(f"tested must be (lowest tested, first untested) versions, got {tested!r}")
        self.name, self.module, self.distribution, self.tested = name, module, distribution, tuple(tested)
        self._lock = threading.RLock()
        self._target = self._version = None
        self._report = None

    # -- the target library ------------------------------------------------------------------

    @property
    def tested_range(self) -> str:
        return f"{self.distribution}>={self.tested[0]},<{self.tested[1]}"

    def version(self) -> str:
        """The installed version of the target's distribution. Raises IntegrationError if absent."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise IntegrationError(
                f"pyxfer.integrations.{self.name} needs {self.distribution} (tested: {self.tested_range}), "
                f"which is not installed: pip install '{self.tested_range}'", name=self.module) from None

    def target(self):
        """Import the target module (once) after checking its version; return it.
        Raises IntegrationError when it is missing, outside the tested range or fails to import."""
        if self._target is not None:
            return self._target
        version = self.version()
        if not (not _below(version, self.tested[0]) and _below(version, self.tested[1])):
            message = (f"pyxfer.integrations.{self.name} is tested with {self.tested_range}, "
                       f"found {self.distribution} {version}")
            if os.environ.get(_ALLOW_UNTESTED, "") not in ("", "0"):
                warnings.warn(f"{message}; going on because ${_ALLOW_UNTESTED} is set", RuntimeWarning, stacklevel=3)
            else:
                raise IntegrationError(f"{message} (set ${_ALLOW_UNTESTED}=1 to try it anyway)", name=self.module)
        try:
            module = importlib.import_module(self.module)
        except Exception as e:  # ImportError, OSError from a missing shared library, ...
            raise IntegrationError(f"pyxfer.integrations.{self.name}: importing {self.module} "
                                   f"({self.distribution} {version}) failed: {type(e).__name__}: {e}",
                                   name=self.module) from e
        self._target = module
        self._version = version
        return module

    # -- what subclasses provide -------------------------------------------------------------

    def bindings(self, target, **options):
        """Yield (owner, attribute name, replacement) for every binding to replace. ``target`` is
        the imported target module; ``options`` are patch()'s keyword arguments (raise TypeError /
        ValueError for bad ones). Called once per patch(), before anything is changed."""
        raise NotImplementedError

    # -- the contract ------------------------------------------------------------------------

    def is_patched(self) -> bool:
        """Whether this integration's bindings are currently replaced by pyxfer."""
        return self._report is not None

    def report(self):
        """The PatchReport of the active patch, or None."""
        return self._report

    def patch(self, **options) -> PatchReport:
        """Replace every binding (all or none). Returns the PatchReport; idempotent (see the module
        docstring). Raises IntegrationError (target missing / untested / a binding not found),
        ValueError when already patched with other options."""
        with self._lock:
            if self._report is not None:
                if options != self._report.options:
                    raise ValueError(f"pyxfer.integrations.{self.name} is already patched with options "
                                     f"{self._report.options}, not {options}: unpatch() first")
                return self._report
            target = self.target()
            found, seen = [], set()
            for owner, attribute, replacement in self.bindings(target, **options):
                key = (id(owner), attribute)
                if key in seen:
                    raise RuntimeError(f"pyxfer.integrations.{self.name}: binding {_qualname(owner)}.{attribute} "
                                       f"listed twice")
                seen.add(key)
                own, original = _own_attribute(owner, attribute)
                if not own:
                    if not hasattr(owner, attribute):
                        raise IntegrationError(
                            f"pyxfer.integrations.{self.name}: {_qualname(owner)} has no attribute {attribute!r} "
                            f"({self.distribution} {self._version}; tested: {self.tested_range})", name=self.module)
                    original = getattr(owner, attribute)
                found.append(Binding(owner, attribute, original, replacement, inherited=not own))
            done = []
            try:
                for b in found:
                    setattr(b.owner, b.attribute, b.replacement)
                    done.append(b)
            except BaseException:
                _restore(reversed(done))
                raise
            self._report = PatchReport(self.name, self._version, dict(options), tuple(found))
            return self._report

    def unpatch(self, *, force: bool = False) -> None:
        """Put back the original object of every binding (identity preserved). Does nothing when
        not patched. Raises PatchConflictError, changing nothing, if a binding no longer holds
        pyxfer's replacement; ``force=True`` restores the originals anyway, with a warning."""
        with self._lock:
            if self._report is None:
                return
            conflicts = [b for b in self._report.bindings if b.current() is not b.replacement]
            if conflicts:
                what = "; ".join(f"{b.where} now holds {b.current()!r}" for b in conflicts)
                if not force:
                    raise PatchConflictError(
                        f"pyxfer.integrations.{self.name}: cannot unpatch, re-bound by someone else since patch(): "
                        f"{what}. Undo that first, or unpatch(force=True) to restore the originals anyway")
                warnings.warn(f"pyxfer.integrations.{self.name}: unpatch(force=True) overwrites bindings "
                              f"re-bound since patch(): {what}", RuntimeWarning, stacklevel=2)
            _restore(reversed(self._report.bindings))
            self._report = None

    @contextlib.contextmanager
    def patched(self, **options):
        """``with integration.patched(**options) as report:`` patch for the block, unpatch after it
        (also when it raises). A patch applied before the block stays applied after it."""
        with self._lock:
            was_patched = self.is_patched()
            report = self.patch(**options)
        try:
            yield report
        finally:
            if not was_patched:
                self.unpatch()


def _restore(bindings) -> None:
    for b in bindings:
        if b.inherited:
            with contextlib.suppress(AttributeError):
                delattr(b.owner, b.attribute)
        else:
            setattr(b.owner, b.attribute, b.original)
