"""The launcher of tests/userworld.py (run as a script, as root): imports what the
process will run, then enters a mount namespace with the test world's passwd/group (and
the checkout hidden, if asked), sets the unit's limits, drops to the user and runs its
target: fuyoud's main, or a user's script. Argument: a JSON spec (userworld._launcher_argv)."""
import ast, ctypes, importlib, importlib.util, json, os, pkgutil, resource, signal, sys
spec = json.loads(sys.argv[1])
del sys.argv[1]
SKIP = ("__main__", "fuyou_proto.generate")

def load(name):
    """Import a module, or resolve a dotted attribute of one (a lazy module's class)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except Exception:
            pass
        return

def imports_of(tree, package=None, attrs=False):
    """Every module name a source imports (function-level imports too), and (``attrs``)
    the dotted names it uses of modules imported (transformers.GPT2LMHeadModel)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if not package:
                    continue
                try:
                    base = importlib.util.resolve_name("." * node.level + base, package)
                except ImportError:
                    continue
            yield base
            for a in node.names:
                if a.name != "*":
                    yield base + "." + a.name
        elif attrs and isinstance(node, ast.Attribute):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id in sys.modules:
                yield ".".join([sys.modules[node.id].__name__, *reversed(chain)])

def source_of(mod):
    path = getattr(mod, "__file__", None)
    if path and path.endswith(".py"):
        try:
            with open(path, "rb") as f:
                return ast.parse(f.read())
        except (OSError, SyntaxError):
            return None

home = os.environ.get("HOME")
before = set()
if home and os.path.isdir(home):
    for d, dirs, files in os.walk(home):
        before.update(os.path.join(d, x) for x in dirs + files)
names = []
for root in spec["walk"]:
    try:
        pkg = importlib.import_module(root)
    except Exception as exc:
        print(f"userworld: cannot import {root}: {exc}", file=sys.stderr)
        continue
    mods = [pkg]
    for info in pkgutil.walk_packages(pkg.__path__, root + ".", onerror=lambda name: None):
        if info.name.endswith(SKIP[0]) or info.name in SKIP:
            continue
        try:
            mods.append(importlib.import_module(info.name))
        except Exception:
            pass
    for mod in mods:
        tree = source_of(mod)
        if tree is not None:
            pkgname = mod.__name__ if hasattr(mod, "__path__") else mod.__name__.rpartition(".")[0]
            names.extend(imports_of(tree, pkgname))
for name in spec["names"]:
    load(name)
if spec.get("script") is not None:
    script_tree = ast.parse(spec["script"])
    for name in list(imports_of(script_tree)):  # (imports first: then its dotted names resolve)
        load(name)
    names.extend(imports_of(script_tree, attrs=True))
for name in dict.fromkeys(names):
    if not name.endswith(SKIP[0]) and name not in SKIP:
        load(name)

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
def check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
MS_RDONLY, MS_BIND, MS_REC, MS_PRIVATE = 1, 4096, 16384, 1 << 18
if spec["etc"] or spec["hide"]:
    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    for name in ("passwd", "group") if spec["etc"] else ():
        src = os.path.join(spec["etc"], name).encode()
        check(libc.mount(src, b"/etc/" + name.encode(), None, MS_BIND, None), f"bind-mounting /etc/{name}")
    for path in spec["hide"]:
        check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_RDONLY, b"mode=0700,size=4k"), f"hiding {path}")

for res, value in spec["rlimits"]:  # (as far as this host lets root raise them)
    which = getattr(resource, res)
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        hard = resource.getrlimit(which)[1]
        fits = hard == resource.RLIM_INFINITY or (value != resource.RLIM_INFINITY and value <= hard)
        resource.setrlimit(which, (value if fits else hard, hard))
uid, gid = spec["uid"], spec["gid"]
if home and os.path.isdir(home):  # what the imports made there as root (caches) is the user's, as if it had
    for d, dirs, files in os.walk(home):
        for n in (os.path.join(d, x) for x in dirs + files):
            if n not in before and os.lstat(n).st_uid == 0:
                os.lchown(n, uid, gid)
os.setgroups(spec["groups"])
os.setgid(gid)
os.setuid(uid)
if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid or sorted(os.getgroups()) != sorted(spec["groups"]):
    raise SystemExit(f"userworld: dropping to {uid}:{gid} failed")
os.umask(spec["umask"])
os.chdir(spec["cwd"])
if spec.get("daemon_argv") is not None:
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (the unit's NoNewPrivileges=yes)
    os.environ["WATCHDOG_PID"] = str(os.getpid())  # (systemd sets it to the main process)
    from fuyoud.cli import main
    sys.exit(main(spec["daemon_argv"]))
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the test (a uid change cleared it)
if os.getppid() != spec["parent"]:
    sys.exit(137)
sys.argv = ["<user script>", *spec["args"]]
exec(compile(spec["script"], "<user script>", "exec"), {"__name__": "__main__"})
