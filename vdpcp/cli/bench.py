"""`vdpcp bench TARGET`: run a benchmark and print its figures."""

import importlib

# target name -> module defining add_arguments(parser) and run(args) -> exit code (see vdpcp/bench)
TARGETS = {
    "faults": "vdpcp.bench.faults",
    "harness": "vdpcp.bench.harness",
    "memory": "vdpcp.bench.memory",
    "sensitivity": "vdpcp.bench.sensitivity",
    "towers": "vdpcp.bench.towers",
    "wire": "vdpcp.bench.wire",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help=__doc__.split(": ", 1)[1], description=__doc__)
    targets = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, module_name in TARGETS.items():
        module = importlib.import_module(module_name)
        target = targets.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__)
        module.add_arguments(target)
        target.set_defaults(func=module.run)
