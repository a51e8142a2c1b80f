"""JupyterHub for a class taking the course, with nbgrader's exchange (see README.md in this folder).

    jupyterhub -f autograde/classroom/jupyterhub_config.py      (run by root, from the hub's state folder)

Instructors get the formgrader and the Create Assignment tools; students get the Assignment List only.
The hub puts autograde/classroom/jupyter-config/<role>/ on each server's JUPYTER_CONFIG_PATH: that folder
holds the role's nbgrader_config.py (course id, exchange, and for instructors the class folder) and
switches nbgrader's server and JupyterLab extensions on or off. Everything else comes from variables:

    KVCOURSE_INSTRUCTORS   instructor accounts, comma-separated (default: instructor)
    KVCOURSE_STUDENTS      student accounts, comma-separated, and/or
    KVCOURSE_ROSTER        a file with one student account per line
    KVCOURSE_EXCHANGE      nbgrader's exchange, shared by all (default /srv/nbgrader/exchange)
    KVCOURSE_CLASS_DIR     an instructor's class folder; {username} is replaced (default ~/kvcourse-class)
    KVCOURSE_HUB_STATE     where the hub keeps its database and cookie secret (default: the current folder)
    KVCOURSE_HUB_IP, KVCOURSE_HUB_PORT            public address (default all interfaces, port 8000)
    KVCOURSE_HUB_SSL_CERT, KVCOURSE_HUB_SSL_KEY   serve HTTPS directly (or put a TLS proxy in front)
    KVCOURSE_HUB_AUTH      authenticator (default "pam": the machine's accounts; "dummy" for tests only)
    KVCOURSE_HUB_SPAWNER   spawner (default "localprocess": one Unix account per user; "simple": tests only)
    KVCOURSE_HUB_HOMES     home folder template for the "simple" spawner (default /tmp/{username})
    KVCOURSE_HUB_API_PORT, KVCOURSE_PROXY_API_PORT   the hub's and the proxy's internal ports (8081, 8001)
    KVCOURSE_HUB_API_TOKEN   if set, a service "kvcourse-admin" holding this token may manage users,
                             servers and tokens through the REST API (used by the tests; keep it secret)
    KVCOURSE_CHP           configurable-http-proxy (default: .state/node/ in the project, else on PATH)
"""
import os
import shutil
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent.parent
ROLE_CONFIG = {"instructor": HERE / "jupyter-config" / "instructor", "student": HERE / "jupyter-config" / "student"}


def names(value: str) -> list:
    return [n.strip() for n in value.replace("\n", ",").split(",") if n.strip() and not n.strip().startswith("#")]


INSTRUCTORS = names(os.environ.get("KVCOURSE_INSTRUCTORS", "instructor"))
STUDENTS = names(os.environ.get("KVCOURSE_STUDENTS", ""))
if os.environ.get("KVCOURSE_ROSTER"):
    STUDENTS += names(Path(os.environ["KVCOURSE_ROSTER"]).read_text())
STUDENTS = [s for s in dict.fromkeys(STUDENTS) if s not in INSTRUCTORS]
EXCHANGE = os.environ.get("KVCOURSE_EXCHANGE", "/srv/nbgrader/exchange")
CLASS_DIR = os.environ.get("KVCOURSE_CLASS_DIR", "")  # a template: {username}
STATE = Path(os.environ.get("KVCOURSE_HUB_STATE", os.getcwd())).resolve()

# --- the hub: address, state, proxy
c.JupyterHub.ip = os.environ.get("KVCOURSE_HUB_IP", "")
c.JupyterHub.port = int(os.environ.get("KVCOURSE_HUB_PORT", "8000"))
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ.get("KVCOURSE_HUB_API_PORT", "8081"))
if os.environ.get("KVCOURSE_HUB_SSL_CERT"):
    c.JupyterHub.ssl_cert = os.environ["KVCOURSE_HUB_SSL_CERT"]
    c.JupyterHub.ssl_key = os.environ["KVCOURSE_HUB_SSL_KEY"]
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ.get('KVCOURSE_PROXY_API_PORT', '8001')}"
_chp = PROJECT / ".state" / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
c.ConfigurableHTTPProxy.command = [os.environ.get("KVCOURSE_CHP")
                                   or (str(_chp) if _chp.exists() else shutil.which("configurable-http-proxy")
                                       or "configurable-http-proxy")]

# --- who may log in: the class list. Instructors are hub admins (add users, see who is running).
c.JupyterHub.authenticator_class = os.environ.get("KVCOURSE_HUB_AUTH", "pam")
c.Authenticator.allowed_users = set(INSTRUCTORS + STUDENTS)
c.Authenticator.admin_users = set(INSTRUCTORS)
c.JupyterHub.load_groups = {"kvcourse-instructors": INSTRUCTORS, "kvcourse-students": STUDENTS}

# --- each user's JupyterLab, from the course's environment (nbgrader, the course package, its kernel)
SPAWNER = os.environ.get("KVCOURSE_HUB_SPAWNER", "localprocess")
c.JupyterHub.spawner_class = SPAWNER
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 180  # the first start of JupyterLab on a busy small machine is slow
c.Spawner.http_timeout = 180
c.Spawner.environment = {"KVCOURSE_EXCHANGE": EXCHANGE}
if SPAWNER == "simple":
    c.SimpleLocalProcessSpawner.home_dir_template = os.environ.get("KVCOURSE_HUB_HOMES", "/tmp/{username}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # every server runs as the hub's user: root in a container
        c.Spawner.args = ["--ServerApp.allow_root=True"]


def pre_spawn_hook(spawner):
    """Give the server its role's Jupyter config folder (and an instructor the class folder)."""
    name = spawner.user.name
    role = "instructor" if name in INSTRUCTORS else "student"
    spawner.environment["JUPYTER_CONFIG_PATH"] = str(ROLE_CONFIG[role])
    spawner.environment["KVCOURSE_ROLE"] = role
    # terminals find the course's `kvcourse`, `nbgrader` and `jupyter` first
    spawner.environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    if role == "instructor" and CLASS_DIR:
        spawner.environment["KVCOURSE_CLASS_DIR"] = CLASS_DIR.format(username=name)


c.Spawner.pre_spawn_hook = pre_spawn_hook

# --- optional: an API token for automation (the tests drive the class through it)
if os.environ.get("KVCOURSE_HUB_API_TOKEN"):
    c.JupyterHub.services = [{"name": "kvcourse-admin", "api_token": os.environ["KVCOURSE_HUB_API_TOKEN"]}]
    c.JupyterHub.load_roles = [{"name": "kvcourse-admin", "services": ["kvcourse-admin"],
                                "scopes": ["admin:users", "admin:servers", "tokens", "list:users", "read:users"]}]
