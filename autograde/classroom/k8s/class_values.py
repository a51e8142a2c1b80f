"""Write class.yaml: who is in the class, for the Zero to JupyterHub values beside this file (README.md, step 4).

    python autograde/classroom/k8s/class_values.py --instructors prof --roster students.txt > class.yaml

The same inputs as the one-server hub (autograde/classroom/jupyterhub_config.py: KVCOURSE_INSTRUCTORS,
KVCOURSE_STUDENTS, KVCOURSE_ROSTER): names separated by commas or lines, '#' starts a comment. It writes the
hub's allowed users, its admins (the instructors) and its two groups, and the class's Unix accounts: one UID
per person, mounted into every server at /var/lib/extrausers/passwd. nbgrader's exchange relies on those UIDs
to keep hand-ins apart (a submission folder's owner is who made it), and `kvcourse classroom collect` on them
to name a submission made under someone else's name. A UID is derived from the name alone, so it never changes
when the list does; should two names ever share one (about once in 8,600 classes of 500), give one of them its
own as NAME:UID in the list.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import yaml

UID_BASE, UID_SPAN = 100_000, 2 ** 30  # far above system and desktop accounts, below 2**31
NAME = re.compile(r"[a-z0-9_][a-z0-9_.@+-]*")  # JupyterHub lowercases names; no ':' or spaces (passwd's format)
PASSWD = "/var/lib/extrausers/passwd"


def names(value: str) -> list[str]:
    return [n.strip() for n in value.replace("\n", ",").split(",") if n.strip() and not n.strip().startswith("#")]


def uid_of(name: str) -> int:
    return UID_BASE + int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % UID_SPAN


def accounts(entries: list[str]) -> dict[str, int]:
    """{name: uid} from 'name' or 'name:uid' entries. ValueError naming the entry for a bad name or a shared UID."""
    table: dict[str, int] = {}
    for entry in entries:
        name, _, uid = entry.lower().partition(":")
        if not NAME.fullmatch(name):
            raise ValueError(f"{entry!r} is not an account name (letters, digits and _ . @ + - only)")
        if uid and not (uid.isdigit() and 1000 <= int(uid) < 2 ** 31):
            raise ValueError(f"{entry!r}: a UID must be a whole number from 1000 to {2 ** 31 - 1}")
        table.setdefault(name, int(uid) if uid else uid_of(name))
    owners: dict[int, str] = {}
    for name, uid in table.items():
        if uid in owners:
            raise ValueError(f"{owners[uid]} and {name} both have UID {uid}: write one of them as "
                             f"{name}:{uid_of(name + '#')} in the list")
        owners[uid] = name
    return table


def read_roster(path: Path) -> str:
    """The roster's text; ValueError saying what is wrong with the file (not a file, too large, unreadable)."""
    try:
        if not path.is_file():
            raise ValueError(f"the roster {path} is not a file: give a text file, one account per line")
        if path.stat().st_size > 1_000_000:
            raise ValueError(f"the roster {path} is over 1 MB: give a text file, one account per line")
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the roster {path} ({getattr(exc, 'strerror', None) or exc})") from None


def class_values(instructors: dict[str, int], students: dict[str, int]) -> dict:
    students = {n: u for n, u in students.items() if n not in instructors}
    lines = [f"{n}:x:{u}:100:kvcourse {role}:/home/jovyan:/bin/bash"
             for role, group in (("instructor", instructors), ("student", students)) for n, u in group.items()]
    return {
        "hub": {"config": {
            "Authenticator": {"allowed_users": sorted({**instructors, **students}), "admin_users": sorted(instructors)},
            "JupyterHub": {"load_groups": {"kvcourse-instructors": {"users": sorted(instructors)},
                                           "kvcourse-students": {"users": sorted(students)}}}}},
        "singleuser": {"extraFiles": {"kvcourse-passwd": {"mountPath": PASSWD, "stringData": "\n".join(lines) + "\n"}}},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instructors", required=True, help="instructor accounts, comma-separated")
    p.add_argument("--students", default="", help="student accounts, comma-separated")
    p.add_argument("--roster", type=Path, help="a file with one student account per line")
    args = p.parse_args(argv)
    students = names(args.students)
    try:
        if args.roster:
            students += names(read_roster(args.roster))
        table = accounts(names(args.instructors) + students)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    teachers = {n.lower().partition(":")[0] for n in names(args.instructors)}
    values = class_values({n: u for n, u in table.items() if n in teachers},
                          {n: u for n, u in table.items() if n not in teachers})
    sys.stdout.write("# written by autograde/classroom/k8s/class_values.py: who is in the class\n")
    sys.stdout.write(yaml.safe_dump(values, sort_keys=False, width=120))
    return 0


if __name__ == "__main__":
    sys.exit(main())
