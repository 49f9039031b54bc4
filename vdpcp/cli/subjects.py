"""`vdpcp subjects`: every registered implementation, and for each shipped one whether it can run here.

A shipped subject that cannot run here (a package missing, or of a version it does not take) gets one line: the
package, the versions it takes, the install command.
"""

from __future__ import annotations

from vdpcp.cli.exit_codes import Exit, epilog


def register(subparsers) -> None:
    parser = subparsers.add_parser("subjects", help=__doc__.splitlines()[0].split(": ", 1)[1], description=__doc__,
                                   epilog=epilog("subjects"))
    parser.set_defaults(func=main)


def main(args) -> int:
    from vdpcp.impls import SHIPPED, available, unavailable

    for name, target in sorted(available().items()):
        why = unavailable(name) if name in SHIPPED else ""
        print(f"{name:24} {'unavailable: ' + why if why else target}")
    return Exit.PASSED
