"""``python -m verl_sat.report``, kept for one release: the module is ``verl_sat.paper.report``."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("verl_sat.paper.report", run_name="__main__", alter_sys=True)
