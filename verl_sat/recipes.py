"""``python -m verl_sat.recipes``, kept for one release: the module is ``verl_sat.paper.grid``."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("verl_sat.paper.grid", run_name="__main__", alter_sys=True)
