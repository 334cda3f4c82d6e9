"""Every place the package wraps or assigns into vLLM is on the patch index.

docs/maintaining/patches.md lists, per vLLM function or attribute touched, its
sites as `<file>.py: <what>`. Read here from the package's syntax trees (nothing is
imported): every ``wrapt`` call or reference, every ``setattr``/``delattr`` (and
``__setattr__`` on another object), every write into an object's ``__dict__``,
and every assignment to an attribute (or an item of an attribute) of a name that
may hold a vLLM object. Which names may is read conservatively: a name imported
from ``vllm`` or ``torch`` (or the package's protocols of vLLM's objects), a
parameter named or annotated like one (a scheduler, request, config, module,
class, connector, pool, model state, a wrapper's ``instance``), and any name
assigned from an expression that mentions such a name. ``self`` is the
package's own object.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_mamba_align"
INDEX = REPO / "docs" / "maintaining" / "patches.md"

VLLM_WORDS = re.compile(
    r"sched|request|config|engine|module|model_state|instance|wrapped|owner|"
    r"connector|pool|worker|runner|manager|platform|vllm|torch|klass|class",
    re.IGNORECASE,
)
"""Names (or annotations) of what may be a vLLM object."""
OWN = {"self", "cls"}
FOREIGN_PACKAGES = ("vllm", "torch")
DICT_WRITES = {"setdefault", "update", "__setitem__", "pop", "clear"}


def _root(node: ast.expr) -> ast.expr:
    """The name an attribute, item or call chain starts from."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call | ast.Starred):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _call_key(call: ast.Call) -> str:
    """A call as the index names it: the callee and its first two arguments."""
    arguments = ", ".join(ast.unparse(argument) for argument in call.args[:2])
    return f"{ast.unparse(call.func)}({arguments})"


def _imports(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to wrapt (the module, or what is imported from it), and
    names bound to vLLM's (or torch's) modules and objects."""
    wrapt, foreign = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                bound = alias.asname or top
                if top == "wrapt":
                    wrapt.add(bound)
                elif top in FOREIGN_PACKAGES:
                    foreign.add(bound)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {alias.asname or alias.name for alias in node.names}
            top = module.split(".")[0] if node.level == 0 else ""
            if top == "wrapt":
                wrapt |= names
            elif top in FOREIGN_PACKAGES or module.endswith("protocols"):
                foreign |= names
    return wrapt, foreign


def _parameters(node: ast.AST) -> list[ast.arg]:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return []
    arguments = node.args
    extra = [arguments.vararg, arguments.kwarg]
    return [
        *arguments.posonlyargs,
        *arguments.args,
        *arguments.kwonlyargs,
        *[argument for argument in extra if argument is not None],
    ]


def _assignments(tree: ast.Module) -> list[tuple[list[ast.expr], ast.expr]]:
    found: list[tuple[list[ast.expr], ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            found.append((node.targets, node.value))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
            if node.value is not None:
                found.append(([node.target], node.value))
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            found.append(([node.target], node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            found.append(([node.optional_vars], node.context_expr))
    return found


def _names(node: ast.AST) -> set[str]:
    return {name.id for name in ast.walk(node) if isinstance(name, ast.Name)}


def _may_hold_vllm(tree: ast.Module, foreign: set[str]) -> set[str]:
    """Every name of the module (any scope) that may hold a vLLM object."""
    bound = set(foreign)
    for node in ast.walk(tree):
        for parameter in _parameters(node):
            annotation = (
                ast.unparse(parameter.annotation) if parameter.annotation else ""
            )
            if (
                VLLM_WORDS.search(parameter.arg)
                or VLLM_WORDS.search(annotation)
                or set(re.findall(r"\w+", annotation)) & foreign
            ):
                bound.add(parameter.arg)
    assignments = _assignments(tree)
    for targets, _ in assignments:
        for target in targets:
            bound |= {name for name in _names(target) if VLLM_WORDS.search(name)}
    grown = True
    while grown:  # names assigned from such a name, to a fixed point
        grown = False
        for targets, value in assignments:
            if not _names(value) & bound:
                continue
            for target in targets:
                new = _names(target) - bound - OWN
                bound |= new
                grown = grown or bool(new)
    return bound - OWN


def sites(source: str) -> set[str]:
    """The places this module wraps with wrapt or assigns into an object that
    may be vLLM's, each as `what` in the index's `file.py: what`."""
    tree = ast.parse(textwrap.dedent(source))
    wrapt, foreign = _imports(tree)
    bound = _may_hold_vllm(tree, foreign)
    found: set[str] = set()
    callees = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}

    def vllms(node: ast.expr) -> bool:
        root = _root(node)
        return isinstance(root, ast.Name) and root.id in bound

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found |= _call_site(node, wrapt)
        elif isinstance(node, ast.Attribute | ast.Name) and isinstance(
            node.ctx, ast.Load
        ):
            # wrapt named outside a call: a decorator, a base class, an alias.
            text = ast.unparse(node)
            head = text.split(".")[0]
            whole_module = (
                isinstance(node, ast.Name)
                and node.id in wrapt
                and (_is_module_alias(tree, node.id))
            )
            if head in wrapt and id(node) not in callees and not whole_module:
                found.add(text)
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Delete):
            targets = (
                node.targets
                if isinstance(node, ast.Assign | ast.Delete)
                else [node.target]
            )
            for target in targets:
                for part in ast.walk(target):
                    if not isinstance(part, ast.Attribute | ast.Subscript):
                        continue
                    if not isinstance(part.ctx, ast.Store | ast.Del):
                        continue
                    holder = part.value
                    into_attribute = isinstance(part, ast.Attribute) and vllms(holder)
                    into_item = isinstance(part, ast.Subscript) and (
                        (isinstance(holder, ast.Attribute) and vllms(holder))
                        or (
                            isinstance(holder, ast.Call)
                            and ast.unparse(holder.func) == "vars"
                        )
                    )
                    if into_attribute or into_item:
                        found.add(ast.unparse(part))
    return found


def _is_module_alias(tree: ast.Module, name: str) -> bool:
    """Whether ``name`` is bound by ``import wrapt`` (its attributes are the
    sites, not the module's name inside them)."""
    return any(
        isinstance(node, ast.Import)
        and any(
            (alias.asname or alias.name.split(".")[0]) == name for alias in node.names
        )
        for node in ast.walk(tree)
    )


def _call_site(call: ast.Call, wrapt: set[str]) -> set[str]:
    func = call.func
    head = ast.unparse(func).split(".")[0]
    if head in wrapt:
        return {_call_key(call)}
    if isinstance(func, ast.Name) and func.id in ("setattr", "delattr"):
        return {_call_key(call)}
    if isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__"):
        first = call.args[0] if call.args else None
        if isinstance(first, ast.Name) and first.id in OWN:
            return set()  # the package's own object, set from its own class
        return {_call_key(call)}
    if (
        isinstance(func, ast.Attribute)
        and func.attr in DICT_WRITES
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "__dict__"
    ):
        return {_call_key(call)}
    return set()


def package_sites() -> set[str]:
    return {
        f"{path.relative_to(PACKAGE).as_posix()}: {site}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for site in sites(path.read_text())
    }


def indexed_sites(text: str | None = None) -> set[str]:
    """The sites the index lists: every `file.py: what` in backticks."""
    text = INDEX.read_text() if text is None else text
    return {
        f"{path}: {what}" for path, what in re.findall(r"`([\w/]+\.py): ([^`]+)`", text)
    }


def unlisted(found: set[str], listed: set[str]) -> list[str]:
    """The sites found in the code that the index does not list."""
    return sorted(found - listed)


def test_every_wrap_and_assignment_into_vllm_has_its_card() -> None:
    missing = unlisted(package_sites(), indexed_sites())
    assert missing == [], (
        "sites without a card in docs/maintaining/patches.md (add them to the "
        f"card of the vLLM function they touch): {missing}"
    )


def test_every_site_on_the_index_exists() -> None:
    stale = sorted(indexed_sites() - package_sites())
    assert stale == [], (
        f"docs/maintaining/patches.md lists sites the code lacks: {stale}"
    )


def test_the_index_is_linked_from_the_maintainers_page() -> None:
    assert "(patches.md)" in (INDEX.parent / "index.md").read_text()


# -- adversaries: the same reader on code written to slip past it --------------


def test_a_new_wrapt_wrap_is_a_site() -> None:
    source = """
        import wrapt

        def patch(module):
            wrapt.wrap_function_wrapper(module, "Scheduler.schedule", observe)
    """
    assert sites(source) == {
        "wrapt.wrap_function_wrapper(module, 'Scheduler.schedule')"
    }
    assert "x.py: wrapt.wrap_function_wrapper(module, 'Scheduler.schedule')" not in (
        indexed_sites()
    )


def test_wrapt_imported_by_name_used_as_decorator_or_base_is_a_site() -> None:
    source = """
        from wrapt import ObjectProxy, decorator as wrap

        class Spy(ObjectProxy):
            pass

        @wrap
        def observe(wrapped, instance, args, kwargs):
            return wrapped(*args, **kwargs)

        proxy = ObjectProxy(object())
    """
    assert sites(source) == {"ObjectProxy", "wrap", "ObjectProxy(object())"}


def test_a_wrapt_alias_is_still_wrapt() -> None:
    source = """
        import wrapt as w

        w.FunctionWrapper(f, wrapper)
    """
    assert sites(source) == {"w.FunctionWrapper(f, wrapper)"}


def test_a_new_setattr_is_a_site_whatever_it_sets() -> None:
    source = """
        def bind(thing, value):
            setattr(thing, "_vllm_mamba_align_extra", value)
            object.__setattr__(thing, "other", value)
            delattr(thing, "gone")
    """
    assert sites(source) == {
        "setattr(thing, '_vllm_mamba_align_extra')",
        "object.__setattr__(thing, 'other')",
        "delattr(thing, 'gone')",
    }


def test_an_assignment_into_a_vllm_object_is_a_site() -> None:
    """By the name's words, its annotation, an import from vLLM, or an
    assignment from such a name two steps away."""
    source = """
        from vllm.v1.core.sched.scheduler import Scheduler as S
        from .protocols import Request

        def tweak(scheduler, item: Request, other: "S", plain):
            scheduler.max_num_running_reqs = 1
            item.num_computed_tokens += 1
            other.policy = "fcfs"
            blocks = scheduler.kv_cache_manager
            pool = blocks
            renamed = pool
            renamed.block_pool.free = None
            scheduler.__dict__["schedule"] = plain
            vars(plain)["x"] = 1
            scheduler.requests["r"] = None
            S.schedule = None
            plain.harmless = 1
            self_made = {}
            self_made["k"] = 1

        class Own:
            def __init__(self):
                self.fine = 1
                object.__setattr__(self, "frozen", 1)
    """
    assert sites(source) == {
        "scheduler.max_num_running_reqs",
        "item.num_computed_tokens",
        "other.policy",
        "renamed.block_pool.free",
        "scheduler.__dict__['schedule']",
        "vars(plain)['x']",
        "scheduler.requests['r']",
        "S.schedule",
    }


def test_a_write_into_an_instance_dict_is_a_site() -> None:
    source = """
        def wrapper(wrapped, instance, args, kwargs):
            instance.__dict__.update(extra=1)
    """
    assert sites(source) == {"instance.__dict__.update()"}


NEW_WRAP = """
    import wrapt

    def patch(module):
        wrapt.wrap_function_wrapper(module, "Scheduler.schedule", observe)
"""
NEW_SETATTR = """
    def bind(scheduler, value):
        setattr(scheduler, "_vllm_mamba_align_extra", value)
"""


@pytest.mark.parametrize(
    ("source", "key"),
    [
        (
            NEW_WRAP,
            "plugin.py: wrapt.wrap_function_wrapper(module, 'Scheduler.schedule')",
        ),
        (NEW_SETATTR, "plugin.py: setattr(scheduler, '_vllm_mamba_align_extra')"),
    ],
    ids=["wrap", "setattr"],
)
def test_a_new_site_without_its_card_fails_the_check(source: str, key: str) -> None:
    """The package's sites plus one written into plugin.py: the check names it."""
    found = package_sites() | {f"plugin.py: {site}" for site in sites(source)}
    assert unlisted(found, indexed_sites()) == [key]
    carded = indexed_sites() | {key}
    assert unlisted(found, carded) == []


def test_the_index_is_read_from_backticked_sites() -> None:
    page = "- `split.py: scheduler.cache_config` (the view)\n- `<file>.py: <what>`\n"
    assert indexed_sites(page) == {"split.py: scheduler.cache_config"}


def _defined(tree: ast.Module) -> set[str]:
    """A module's top-level names, and ``Class.name`` for its classes' names."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.ClassDef):
            for inner in node.body:
                for name in _defined(ast.Module(body=[inner], type_ignores=[])):
                    names.add(f"{node.name}.{name}")
    return names


def test_dropping_a_release_names_only_what_exists() -> None:
    """The page's checklist for dropping a release names files that exist and
    names that the file it places them in defines (the package, unless a
    ``file.py``'s comes right before the name)."""
    text = INDEX.read_text()
    section = text[text.index("## Dropping a release") :]
    trees = {
        path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))
    }
    package = set().union(*(_defined(tree) for tree in trees.values()))
    missing = []
    for match in re.finditer(r"(`([\w/.]+\.py)`'s )?`([\w/.*]+)`", section):
        owner, name = match.group(2), match.group(3)
        if name.endswith((".py", "/")):
            if not any((root / name).exists() for root in (PACKAGE, REPO)):
                missing.append(name)
            continue
        if owner is not None:
            defined = _defined(ast.parse((REPO / owner).read_text()))
        elif "." in name and (PACKAGE / f"{name.split('.')[0]}.py").exists():
            module, name = name.split(".", 1)
            defined = _defined(trees[PACKAGE / f"{module}.py"])
        else:
            defined = package
        found = (
            any(d.startswith(name[:-1]) for d in defined)
            if name.endswith("*")
            else name in defined
        )
        if not found:
            missing.append(match.group(0))
    assert missing == []


def _cards(text: str) -> dict[str, str]:
    """The page's cards by heading (the text after ``## ``)."""
    parts = re.split(r"(?m)^## ", text)[1:]
    return {part.split("\n", 1)[0]: part for part in parts}


def _files_named(card: str) -> set[str]:
    """The package files a card's **Files** entry names (``x.py``, ``dir/``)."""
    unescaped = card.replace("\\_", "_")  # markdown's escaped underscores
    match = re.search(r"- \*\*Files\*\*:(.*?)(?=\n- \*\*|\Z)", unescaped, re.DOTALL)
    if match is None:
        return set()
    return set(re.findall(r"(?<![\w./])(\w+(?:/[\w.]+)*\.py|\w+/)", match.group(1)))


def test_every_file_a_card_names_exists() -> None:
    missing = {
        heading: sorted(
            name for name in _files_named(card) if not (PACKAGE / name).exists()
        )
        for heading, card in _cards(INDEX.read_text()).items()
    }
    assert {heading: names for heading, names in missing.items() if names} == {}


def test_the_splits_card_names_every_module_the_route_reads() -> None:
    """The route module (split.py) and the package modules it imports, but
    the typing protocols of vLLM's objects, are named on the split's card."""
    card = next(
        text
        for heading, text in _cards(INDEX.read_text()).items()
        if heading.startswith("The split:")
    )
    named = set(re.findall(r"\b(\w+\.py)\b", card))
    tree = ast.parse((PACKAGE / "split.py").read_text())
    imported = {
        f"{node.module}.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    }
    assert "split.py" in _files_named(card)
    assert sorted(imported - {"protocols.py"} - named) == []


def test_a_card_naming_a_deleted_file_fails_the_check() -> None:
    card = "## The x: `f`\n\n- **Files**: split.py, signature.py, audit/.\n"
    assert _files_named(card) == {"split.py", "signature.py", "audit/"}
    assert not (PACKAGE / "signature.py").exists()
