"""`vdpcp bench TARGET`: run a benchmark and print its figures."""

import importlib

from vdpcp.cli.exit_codes import epilog

# target name -> module defining add_arguments(parser) and run(args) -> exit code (vdpcp.tools.bench)
TARGETS = {
    "faults": "vdpcp.tools.bench.faults",
    "harness": "vdpcp.tools.bench.harness",
    "memory": "vdpcp.tools.bench.memory",
    "sensitivity": "vdpcp.tools.bench.sensitivity",
    "towers": "vdpcp.tools.bench.towers",
    "wire": "vdpcp.tools.bench.wire",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help=__doc__.split(": ", 1)[1], description=__doc__, epilog=epilog("bench"))
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, module_name in TARGETS.items():
        module = importlib.import_module(module_name)
        target = targets.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                                    epilog=epilog("bench"))
        module.add_arguments(target)
        target.set_defaults(func=module.run)
