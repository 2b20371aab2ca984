#!/usr/bin/env python3
"""megatron_flags.py: writes megatron_flags.inc, the table of every command-line flag that
Megatron-LM's pretraining scripts accept, for planner/src/megatron_args.cpp. Not run by the build.

Megatron-LM's parser (megatron/training/arguments.py, parse_args: argparse with
allow_abbrev=False) gets its flags two ways, and both are read here with Python's ast, without
importing Megatron (which needs torch):
  - group.add_argument('--flag', ...) calls in arguments.py;
  - ArgumentGroupFactory(SomeConfig, exclude=[...]).build_group(...): one flag per dataclass
    field of SomeConfig and its bases, named as megatron/training/argument_utils.py names them
    (--field-name; a bool defaulting to anything but False becomes --no-field-name and
    --disable-field-name; the field's metadata["argparse_meta"] overrides names and nargs).
Each flag gets how many values it takes (argparse's nargs, 0 for store_true/store_false) and
whether they must be an int or a float.

Usage: python3 megatron_flags.py GIT_DIR [COMMIT] > megatron_flags.inc
  e.g. python3 planner/src/megatron_flags.py /work/.mirror/NVIDIA+Megatron-LM/repo HEAD
"""
import ast
import subprocess
import sys

GIT_DIR = sys.argv[1]
COMMIT = sys.argv[2] if len(sys.argv) > 2 else "HEAD"


def git(*args):
    return subprocess.run(["git", "--git-dir", GIT_DIR, *args], check=True,
                          capture_output=True, text=True).stdout


SHA = git("rev-parse", COMMIT).strip()
DATE = git("show", "-s", "--format=%cs", SHA).strip()


def source(path):
    return git("show", f"{SHA}:{path}")


# Every class defined under megatron/, by name (the config dataclasses and the enums their
# fields use). A name defined twice keeps both; the one a factory means is found by its import.
CLASSES = {}
for path in git("ls-tree", "-r", "--name-only", SHA, "megatron/").split():
    if not path.endswith(".py"):
        continue
    try:
        tree = ast.parse(source(path))
    except SyntaxError:
        continue
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            CLASSES.setdefault(node.name, []).append((path, node))


def base_names(cls):
    out = []
    for b in cls.bases:
        if isinstance(b, ast.Name):
            out.append(b.id)
        elif isinstance(b, ast.Attribute):
            out.append(b.attr)
    return out


def is_enum(name):
    for _, cls in CLASSES.get(name, []):
        if any(b in ("Enum", "IntEnum", "StrEnum") for b in base_names(cls)):
            return True
        if any(is_enum(b) for b in base_names(cls) if b in CLASSES):
            return True
    return False


def the_class(name):
    found = CLASSES.get(name, [])
    if len(found) != 1:
        sys.exit(f"class {name}: {len(found)} definitions under megatron/, expected one")
    return found[0][1]


# Arity: (fewest values, most values; -1 unbounded). Kind: int, float or any.
NONE, ONE = (0, 0), (1, 1)


def nargs_arity(nargs):
    if nargs is None:
        return ONE
    if nargs == "?":
        return (0, 1)
    if nargs == "*":
        return (0, -1)
    if nargs == "+":
        return (1, -1)
    if isinstance(nargs, int):
        return (nargs, nargs)
    sys.exit(f"unknown nargs {nargs!r}")


def literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def type_kind(node):
    if isinstance(node, ast.Name) and node.id in ("int", "float"):
        return node.id
    return "any"


FLAGS = {}  # name -> (arity, kind, where)


def add(name, arity, kind, where):
    if name in FLAGS and FLAGS[name][:2] != (arity, kind):
        sys.exit(f"{name}: defined twice differently ({FLAGS[name][2]}, {where})")
    FLAGS[name] = (arity, kind, where)


def read_add_argument(call, where):
    names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    action = kw.get("action")
    action_name = (action.value if isinstance(action, ast.Constant)
                   else action.attr if isinstance(action, ast.Attribute) else None)
    if action_name in ("store_true", "store_false", "store_const", "count", "append_const"):
        arity, kind = NONE, "any"
    elif action_name == "BooleanOptionalAction":
        arity, kind = NONE, "any"
        names += ["--no-" + n[2:] for n in names if n.startswith("--")]
    elif action_name in (None, "store", "append"):
        arity = nargs_arity(literal(kw["nargs"]) if "nargs" in kw else None)
        kind = type_kind(kw.get("type"))
    else:
        sys.exit(f"{where}: unknown action {action_name!r} for {names}")
    for n in names:
        if n.startswith("--"):
            add(n, arity, kind, where)


# Type annotation -> (arity, kind), as ArgumentGroupFactory._extract_type infers it.
def annotation_kwargs(ann):
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # a quoted annotation
        ann = ast.parse(ann.value, mode="eval").body
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):  # X | None
        if isinstance(ann.right, ast.Constant) and ann.right.value is None:
            return annotation_kwargs(ann.left)
        return None  # a Union: TypeInferenceError, unless argparse_meta says
    if isinstance(ann, ast.Name):
        if ann.id == "bool":
            return {"bool": True}
        if ann.id in ("int", "float", "str"):
            return {"arity": ONE, "kind": ann.id if ann.id != "str" else "any"}
        if is_enum(ann.id):
            return {"arity": ONE, "kind": "any"}
        return None
    if isinstance(ann, ast.Attribute) and ann.attr == "Signals":  # signal.Signals, an IntEnum
        return {"arity": ONE, "kind": "any"}
    if isinstance(ann, ast.Subscript):
        head = ann.value.id if isinstance(ann.value, ast.Name) else getattr(ann.value, "attr", None)
        inner = ann.slice
        if head == "Optional":
            return annotation_kwargs(inner)
        if head == "Union":
            elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            if len(elts) == 2 and isinstance(elts[1], ast.Constant) and elts[1].value is None:
                return annotation_kwargs(elts[0])
            return None
        if head in ("list", "List"):
            k = annotation_kwargs(inner)
            if k is None or "bool" in k:
                return None
            return {"arity": (1, -1), "kind": k["kind"]}
        if head == "Literal":
            elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            vals = [literal(e) for e in elts]
            return {"arity": ONE, "kind": "int" if all(isinstance(v, int) for v in vals) else "any"}
    return None


def field_flags(cls_name, exclude, where):
    cls = the_class(cls_name)
    # Bases first (dataclasses.fields order; a later field of one name replaces the earlier).
    for b in base_names(cls):
        if b in CLASSES and any(isinstance(d, (ast.Name, ast.Call, ast.Attribute))
                                for _, c in CLASSES[b] for d in c.decorator_list):
            field_flags(b, exclude, where)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        ann = node.annotation
        if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) in ("ClassVar", "InitVar"):
            continue
        if name in exclude:
            continue
        default, meta = None, {}
        has_default = node.value is not None
        default_node = node.value
        if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "field":
            kw = {k.arg: k.value for k in node.value.keywords}
            if "init" in kw and literal(kw["init"]) is False:
                continue
            has_default = "default" in kw
            default_node = kw.get("default")
            if has_default:
                default = literal(kw["default"])
            if "metadata" in kw:
                md = kw["metadata"]
                if isinstance(md, ast.Dict):
                    for k, v in zip(md.keys, md.values):
                        if literal(k) == "argparse_meta" and isinstance(v, ast.Dict):
                            meta = {literal(mk): mv for mk, mv in zip(v.keys, v.values)}
        elif has_default:
            default = literal(node.value)
        is_none_literal = isinstance(default_node, ast.Constant) and default_node.value is None
        names = ["--" + name.replace("_", "-")]
        kwargs = annotation_kwargs(ann)
        if kwargs is not None and kwargs.get("bool"):
            arity, kind = NONE, "any"
            # argument_utils.py: store_true when the default == False, else store_false
            # named --no-<name> and --disable-<name>.
            if not has_default or (default is None and not is_none_literal):
                sys.exit(f"{cls_name}.{name}: a bool field whose default is not a literal")
            if not (default is not None and default == False):  # noqa: E712, as Megatron writes it
                names = ["--no-" + name.replace("_", "-"), "--disable-" + name.replace("_", "-")]
        elif kwargs is not None:
            arity, kind = kwargs["arity"], kwargs["kind"]
        else:
            arity, kind = ONE, "any"
            if not meta:
                sys.exit(f"{cls_name}.{name}: cannot infer the flag's type and no argparse_meta")
        if "arg_names" in meta:
            names = literal(meta["arg_names"])
        if "nargs" in meta:
            arity = nargs_arity(literal(meta["nargs"]))
        if "type" in meta:
            kind = type_kind(meta["type"])
        if "action" in meta:
            a = literal(meta["action"])
            if a in ("store_true", "store_false"):
                arity, kind = NONE, "any"
        for n in names:
            add(n, arity, kind, f"{where} ({cls_name}.{name})")


ARGS = "megatron/training/arguments.py"
tree = ast.parse(source(ARGS))
for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
        continue
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "add_argument":
        read_add_argument(node, ARGS)
    elif isinstance(f, ast.Name) and f.id == "ArgumentGroupFactory":
        cls = node.args[0].id
        exclude = set()
        for k in node.keywords:
            if k.arg == "exclude":
                v = k.value
                if isinstance(v, ast.Name):  # exclude=exclude: the list assigned above
                    for a in ast.walk(tree):
                        if (isinstance(a, ast.Assign) and isinstance(a.targets[0], ast.Name)
                                and a.targets[0].id == v.id and isinstance(a.value, ast.List)):
                            exclude |= set(literal(a.value))
                else:
                    exclude |= set(literal(v))
        field_flags(cls, exclude, ARGS)

KIND = {"int": "MegatronValue::integer", "float": "MegatronValue::real", "any": "MegatronValue::any"}
print(f"// megatron_flags.inc: every flag Megatron-LM's parse_args accepts ({len(FLAGS)}), written by")
print(f"// planner/src/megatron_flags.py from NVIDIA/Megatron-LM's {ARGS} and the")
print("// config dataclasses its ArgumentGroupFactory reads, at commit")
print(f"// {SHA} ({DATE}).")
print("// Do not edit; rerun the script. Sorted by name: {name, fewest values, most values (-1: no")
print("// limit), the values' type}.")
for name in sorted(FLAGS):
    (lo, hi), kind, _ = FLAGS[name]
    print(f'{{"{name}", {lo}, {hi}, {KIND[kind]}}},')
