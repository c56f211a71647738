"""The sandbox chat templates run in: Jinja's immutable sandbox, bounded in time and size.

A chat template is code that arrives with a model (tokenizer_config.json) or from the user
(`megajax serve --chat-template`), and it runs once per conversation: in training over every
conversation of the data, in the server on every chat request. Jinja's sandbox keeps it from the
filesystem and from Python's internals and caps one `range` at 100,000 items, but not the total work:
nested loops of allowed ranges run for hours, `'x' * 10**9` allocates a gigabyte in one step, a list
of references to one long string joins into terabytes. Each rendering here (and each compilation, where
Jinja folds constant expressions) is bounded:

    RENDER_SECONDS  2 s          wall-clock time of one rendering; a watchdog thread stops the template
                                 (an exception raised in the rendering thread at its next Python step)
    MAX_CHARS       16 Mi chars  the rendered text, and any one string or list the template builds
                                 (a container counts its items, recursively: what printing it would write)
    MAX_BUILT       256 Mi chars all the strings and lists it builds together (a loop that rebuilds a
                                 long string stops here even when each one is under MAX_CHARS)

A normal template renders in well under a millisecond and writes a few characters per token, so the
bounds only touch templates that loop without end or write without end (16 Mi characters are some
4 million tokens, beyond any training sequence or context). Operations that could allocate past a
bound in one step are refused before they run (`*` and `%` on strings and lists, `**`, `join`,
`replace`, the padding methods and filters, `lipsum`); the rest are checked on their result. Going
past a bound raises TemplateLimit, which names the bound; any other failure raises ChatTemplateError.

    compile_template(text) -> jinja2.Template      (cached; ChatTemplateError naming the line)
    bounded(fn) -> fn()                            run a rendering under the bounds
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import inspect
import re
import threading
import time

RENDER_SECONDS = 2.0
MAX_CHARS = 16 * 2**20
MAX_BUILT = 16 * MAX_CHARS
MAX_INT_BITS = 1 << 16  # `**` and `*` on integers: 65,536 bits (19,729 digits) at most


class ChatTemplateError(ValueError):
    """The template is not valid Jinja, or failed while rendering (`raise_exception` sets `refused`)."""

    refused = False  # the template's own raise_exception: it refused the messages


class TemplateLimit(ChatTemplateError):
    """The template went past one of the bounds of this module."""


def output_limit() -> TemplateLimit:
    return TemplateLimit(f"the chat template wrote more than {MAX_CHARS:,} characters (megajax's bound on the text a "
                         f"chat template writes for one conversation)")


class _Overtime(BaseException):
    """Raised in the rendering thread by the watchdog (a BaseException, so no `except Exception` in Jinja
    or in the template's callees swallows it)."""


class _Budget:
    __slots__ = ("deadline", "built", "sizes", "fired", "thread", "active")

    def __init__(self):
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.built = 0
        self.sizes: dict[int, tuple[object, int]] = {}  # id -> (object kept alive, its size)
        self.fired = 0.0  # when the watchdog last raised _Overtime in the rendering thread (0: never)
        self.thread = threading.get_ident()
        self.active = True  # the rendering thread is inside `bounded` (the watchdog may raise there)


_BUDGET: contextvars.ContextVar = contextvars.ContextVar("megajax_template_budget", default=None)


# ----------------------------------------------------------------------------
# Time: one watchdog thread for every rendering in the process
# ----------------------------------------------------------------------------

REFIRE_SECONDS = 0.5  # a raise that the rendering thread swallowed (a gc callback's) is repeated this often


class _Watchdog:
    """Raises _Overtime in a rendering thread past its deadline, and again every REFIRE_SECONDS while it
    is still inside `bounded` (an exception raised asynchronously lands at the thread's next Python step,
    which may be a callback that swallows it). It raises only under `lock`, and only while the budget
    is active; `leave` clears that under the same lock, so no raise reaches a thread that has left."""

    def __init__(self):
        self.lock = threading.Condition()
        self.watched: dict[int, _Budget] = {}
        self.thread: threading.Thread | None = None

    def watch(self, budget: _Budget) -> None:
        with self.lock:
            self.watched[budget.thread] = budget
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="megajax-template-watchdog", daemon=True)
                self.thread.start()
            self.lock.notify()

    def leave(self, budget: _Budget) -> None:
        """Once this returns, the watchdog never raises in the thread for `budget` again, and a raise it
        had already made has been delivered (and recorded in budget.fired)."""
        while True:
            try:
                with self.lock:
                    budget.active = False
                    if self.watched.get(budget.thread) is budget:
                        del self.watched[budget.thread]
                break
            except _Overtime:  # delivered while taking the lock: the lock is released, try again
                budget.fired = budget.fired or time.monotonic()
        try:
            _pending_exception_point()  # a raise made before `active` was cleared lands here at the latest
        except _Overtime:
            budget.fired = budget.fired or time.monotonic()

    def _run(self) -> None:
        with self.lock:
            while True:
                now = time.monotonic()
                for budget in self.watched.values():
                    if budget.active and budget.deadline <= now and now - budget.fired >= REFIRE_SECONDS:
                        budget.fired = now
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(budget.thread),
                                                                   ctypes.py_object(_Overtime))
                wake = [max(b.deadline, b.fired + REFIRE_SECONDS) for b in self.watched.values() if b.active]
                self.lock.wait(max(min(wake) - now, 0.01) if wake else None)


_WATCHDOG = _Watchdog()


def _pending_exception_point() -> None:
    """A Python call: an exception the watchdog has set is raised here at the latest."""


def bounded(fn):
    """fn() (a rendering or a compilation) under this module's bounds; TemplateLimit past one of them.
    Nested calls run under the outer call's bounds."""
    if _BUDGET.get() is not None:
        return fn()
    budget = _Budget()
    token = _BUDGET.set(budget)
    try:
        try:
            _WATCHDOG.watch(budget)
            result = fn()
        except _Overtime:
            budget.fired = budget.fired or time.monotonic()
        finally:
            _WATCHDOG.leave(budget)
        if budget.fired:  # past the deadline, even where the raise landed in a callback that swallowed it
            raise TemplateLimit(f"the chat template ran longer than {RENDER_SECONDS:g} s on one conversation "
                                f"(megajax's bound on a chat template's time)")
        return result
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply (RecursionError: a macro that calls "
                                "itself without end?)") from None
    except MemoryError:
        raise TemplateLimit("the chat template ran out of memory (MemoryError)") from None
    finally:
        _BUDGET.reset(token)


# ----------------------------------------------------------------------------
# Size: what printing an object would write, counted once per object
# ----------------------------------------------------------------------------

_CONTAINERS = (list, tuple, dict, set, frozenset)


def size_of(x, budget: _Budget | None = None) -> int:
    """About the number of characters str(x) has: a string its length, a container its items' sizes plus
    one per item, a number its digits; shared items are counted each time they occur (as printing does),
    computed once per object (a Jinja namespace, which the template changes, each time)."""
    kind = type(x)
    if kind is str:
        return len(x)
    if kind is int:
        return x.bit_length() // 3 + 1
    if isinstance(x, _CONTAINERS):
        if not x:
            return 1
        sizes = budget.sizes if budget is not None else {}
        known = sizes.get(id(x))
        if known is not None:
            return known[1]
        sizes[id(x)] = (x, 0)  # a container holding itself counts it once
        items = [v for kv in x.items() for v in kv] if isinstance(x, dict) else x
        total = len(items) + sum(size_of(item, budget) for item in items)
        sizes[id(x)] = (x, total)
        return total
    if isinstance(x, (str, bytes, bytearray)):
        return len(x)
    if isinstance(x, int) and not isinstance(x, bool):
        return x.bit_length() // 3 + 1
    if type(x).__name__ == "Namespace" and type(x).__module__ == "jinja2.utils":
        attrs = object.__getattribute__(x, "_Namespace__attrs")
        return 1 + len(attrs) + sum(size_of(v, budget) for v in attrs.values() if v is not x)
    return 1


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise TemplateLimit(f"the chat template would build {what}: {size:,} characters, past megajax's bound of "
                            f"{MAX_CHARS:,} on any string or list a chat template builds")


_SCALARS = (int, float, bool, type(None))


def _built(result):
    """`result` of an operation the template ran, checked and counted against the bounds."""
    kind = type(result)
    budget = _BUDGET.get()
    if kind is str:
        size = len(result)
    elif kind in _SCALARS and kind is not int:
        return result
    else:
        size = size_of(result, budget)
    if size > MAX_CHARS:
        _refuse_over(size, "a value")
    if budget is not None:
        budget.built += size
        if budget.built > MAX_BUILT:
            raise TemplateLimit(f"the chat template built strings and lists of more than {MAX_BUILT:,} characters "
                                f"in all (megajax's bound on the work of one rendering)")
    return result


def _check_inputs(args, kwargs) -> None:
    if not args and not kwargs:
        return
    budget = None
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) is str:
            if len(a) > MAX_CHARS:
                _refuse_over(len(a), "an argument")
        elif type(a) not in _SCALARS:
            budget = budget or _BUDGET.get()
            _refuse_over(size_of(a, budget), "an argument")


_NUMBER = re.compile(r"\d+")


def _check_widths(fmt, args) -> None:
    """A printf or str.format pattern whose widths (digits in it, or `*` / nested fields taken from the
    arguments) could write more than MAX_CHARS."""
    if not isinstance(fmt, str):
        return
    numbers = [int(n) for n in _NUMBER.findall(fmt) if len(n) <= 12] + [10**13] * any(
        len(n) > 12 for n in _NUMBER.findall(fmt))
    numbers += [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    _refuse_over(max(numbers, default=0), "a formatted field")


# ----------------------------------------------------------------------------
# The operations that could grow past a bound in one step: checked before they run
# ----------------------------------------------------------------------------

def _estimate_mul(left, right) -> None:
    for seq, n in ((left, right), (right, left)):
        if isinstance(n, int) and not isinstance(n, bool) and isinstance(seq, (str, list, tuple)):
            what = "a string" if isinstance(seq, str) else "a list"
            _refuse_over(size_of(seq, _BUDGET.get()) * max(n, 0), f"{what} repeated {n:,} times")
    if isinstance(left, int) and isinstance(right, int):
        bits = left.bit_length() + right.bit_length()
        if bits > MAX_INT_BITS:
            raise TemplateLimit(f"the chat template would multiply numbers into one of {bits:,} bits; at most "
                                f"{MAX_INT_BITS:,}")


def _estimate_pow(left, right) -> None:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        bits = left.bit_length() * right
        if bits > MAX_INT_BITS:
            raise TemplateLimit(f"the chat template would raise a number to the power {right:,} ({bits:,} bits); at "
                                f"most {MAX_INT_BITS:,} bits")


def _estimate_join(sep, items) -> int:
    budget = _BUDGET.get()
    return sum(size_of(i, budget) for i in items) + size_of(sep, budget) * max(len(items) - 1, 0)


def _estimate_replace(s, old, new, count=-1) -> int:
    s, old, new = str(s), str(old), str(new)
    hits = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


_STR_AMPLIFIERS = frozenset({"join", "replace", "center", "ljust", "rjust", "zfill", "expandtabs", "format",
                             "format_map", "translate"})


def _check_method(method, args, kwargs) -> tuple:
    """Checks a str method call before it runs; returns args (join's iterable made a list)."""
    name = getattr(method, "__name__", "")
    if name not in _STR_AMPLIFIERS:
        return args
    receiver = getattr(method, "__self__", None)
    if not isinstance(receiver, str):
        return args
    if name == "join" and args:
        args = (list(args[0]), *args[1:])
        _refuse_over(_estimate_join(receiver, args[0]), "a joined string")
    elif name == "replace" and len(args) >= 2:
        _refuse_over(_estimate_replace(receiver, *args[:3]), "a string with replacements")
    elif name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _refuse_over(args[0], "a padded string")
    elif name == "expandtabs":
        size = (args or [kwargs.get("tabsize", 8)])[0]
        if isinstance(size, int):
            _refuse_over(len(receiver) + receiver.count("\t") * size, "a string with tabs expanded")
    elif name in ("format", "format_map"):
        _check_widths(receiver, (*args, *kwargs.values()))
    elif name == "translate" and args:
        table = args[0]
        longest = max((size_of(v) for v in table.values()), default=1) if isinstance(table, dict) else 1
        _refuse_over(len(receiver) * longest, "a translated string")
    return args


def _items_and_depth(value, depth: int = 0) -> tuple[int, int]:
    """(items, deepest nesting) of the lists and dicts in a JSON-like value."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return 0, depth
    items, deepest = len(value), depth + 1
    for v in value:
        n, d = _items_and_depth(v, depth + 1)
        items, deepest = items + n, max(deepest, d)
    return items, deepest


def _filter_estimate(name: str, a: dict) -> None:
    """The amplifying filters' result sizes, from their bound arguments."""
    def text(key):
        return str(a.get(key, ""))

    def number(key, default):
        v = a.get(key, default)
        return v if isinstance(v, int) and not isinstance(v, bool) else default

    if name == "center":
        _refuse_over(max(len(text("value")), number("width", 80)), "a centred string")
    elif name == "indent":
        width = a.get("width", 4)
        width = width if isinstance(width, int) and not isinstance(width, bool) else len(str(width))
        s = text("s")
        _refuse_over(len(s) + (s.count("\n") + 1) * width, "an indented string")
    elif name == "wordwrap":
        s, wrap = text("s"), a.get("wrapstring") or "\n"
        _refuse_over(len(s) + (len(s) // max(number("width", 79), 1) + 1) * len(str(wrap)), "a wrapped string")
    elif name == "replace":
        count = a.get("count")
        _refuse_over(_estimate_replace(text("s"), text("old"), text("new"), count if count is not None else -1),
                     "a string with replacements")
    elif name == "format":
        _check_widths(a.get("value"), (*a.get("args", ()), *a.get("kwargs", {}).values()))
    elif name in ("batch", "slice") and a.get("fill_with") is not None:
        _refuse_over(number("linecount" if name == "batch" else "slices", 0), f"a {name} filled out")
    elif name == "slice":
        _refuse_over(number("slices", 0), "a list of slices")
    elif name == "tojson":  # escapes at most double a text; indenting adds a line per item, deeper ones wider
        indent = a.get("indent")
        width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        items, depth = _items_and_depth(a.get("value"))
        _refuse_over(2 * size_of(a.get("value"), _BUDGET.get()) + items * (2 + width * depth), "a JSON text")
    elif name == "sum" and not isinstance(a.get("start", 0), (int, float)):
        items = a.get("iterable", ())
        _refuse_over(len(items) * size_of(items, _BUDGET.get()), "a sum of lists (work)")


_AMPLIFYING = ("join", "center", "indent", "wordwrap", "replace", "format", "batch", "slice", "tojson", "sum")


def bounded_filter(name: str, fn):
    """The filter `fn` with the checks above (its inputs' sizes, an amplifying filter's estimated result,
    its result's size)."""
    from jinja2.utils import _PassArg
    signature = inspect.signature(fn)
    first = next(iter(signature.parameters), "")
    # Jinja hands some filters the evaluation context or environment first, without a parameter of theirs
    lead = int(_PassArg.from_obj(fn) is not None and first not in ("eval_ctx", "environment", "context"))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        _check_inputs(args, kwargs)
        if name not in _AMPLIFYING:
            return _built(fn(*args, **kwargs))
        try:
            bound = signature.bind(*args[lead:], **kwargs)
        except TypeError:
            return _built(fn(*args, **kwargs))  # Jinja's own error for the wrong arguments
        bound.apply_defaults()
        a = bound.arguments
        if name in ("join", "sum"):  # the items listed first: a generator is read once
            key = "value" if name == "join" else "iterable"
            a[key] = list(a[key])
            if name == "join":
                _refuse_over(_estimate_join(a.get("d", ""), a[key]), "a joined string")
            else:
                _filter_estimate(name, a)
            return _built(fn(*args[:lead], *a.values()))  # Jinja's wrappers read their arguments by position
        _filter_estimate(name, a)
        return _built(fn(*args, **kwargs))
    return run


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    from jinja2.utils import generate_lorem_ipsum
    _refuse_over(int(n) * int(max) * 16, "lorem ipsum")
    return generate_lorem_ipsum(n, html, min, max)


# ----------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------

def _code_generator():
    from jinja2.compiler import CodeGenerator

    class Bounded(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: each operand's size is checked before the join
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.bounded_concat({join}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")
    return Bounded


def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "%", "**"})
        code_generator_class = _code_generator()

        def __init__(self, **options):
            super().__init__(finalize=self._finalize_output, **options)
            self.concat = self._bounded_join  # the rendered text and every captured block (macros, set blocks)
            self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
            self.globals["lipsum"] = _lipsum

        @staticmethod
        def _finalize_output(value):
            if type(value) is not str:
                _refuse_over(size_of(value, _BUDGET.get()), "an output")
            return value  # a string's length is counted by the output's own bound

        @staticmethod
        def _bounded_join(pieces) -> str:
            out, total = [], 0
            for piece in pieces:
                total += len(piece)
                if total > MAX_CHARS:
                    raise output_limit()
                out.append(piece)
            return "".join(out)

        @staticmethod
        def bounded_concat(join, operands):
            _refuse_over(sum(size_of(o, _BUDGET.get()) for o in operands), "a string (`~`)")
            return _built(join(operands))

        def call_binop(self, context, operator, left, right):
            if operator == "+":
                return _built(left + right)
            if operator == "*":
                _estimate_mul(left, right)
            elif operator == "**":
                _estimate_pow(left, right)
            elif operator == "%" and isinstance(left, str):
                _check_widths(left, right if isinstance(right, tuple) else (right,))
                _refuse_over(size_of(left) + size_of(right, _BUDGET.get()), "a formatted string")
            return _built(self.binop_table[operator](left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
            _check_inputs(args, kwargs)
            args = _check_method(getattr(__obj, "__wrapped__", __obj), args, kwargs)
            return _built(super().call(__context, __obj, *args, **kwargs))

    return BoundedSandbox


def environment(**options):
    """A new bounded sandbox (Jinja's ImmutableSandboxedEnvironment, with the checks above)."""
    return _environment_class()(**options)
