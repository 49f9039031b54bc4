pytest_plugins = ["vdpcp.pytest_plugin"]
