"""A pytest plugin for CI: several pytest processes share one suite, a module at a time.

    PYTHONPATH=.ci python -m pytest -p claims --claims DIR tests

Each process collects the whole suite, then runs, in collection order (the modules of
``--claims-first`` before the others), each module it claims first (an exclusive ``mkdir`` in DIR); a module another process claimed is left to
that one. Together they run every module once, each whole in one process (its module
fixtures built once), and a process that finishes early takes the modules left: the
cores stay busy to the end without a table of how long each module takes. DIR/ran lists
the modules each process ran: process, module, tests, seconds, CPU seconds (the process's
and its children's).
"""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--claims", default=None, metavar="DIR",
                     help="run only the test modules this process claims first in DIR")
    parser.addoption("--claims-first", default="", metavar="MODULES",
                     help="these modules (space-separated paths) are claimed before the rest")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    folder = session.config.getoption("claims")
    if not folder or session.config.option.collectonly:
        return None                 # pytest's own loop
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    os.makedirs(folder, exist_ok=True)
    modules = {}
    for item in session.items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    # the longest modules first, so that no lane is left with one at the end
    first = [m for m in session.config.getoption("claims_first").split() if m in modules]
    modules = {m: modules[m] for m in first + [m for m in modules if m not in first]}
    for name, items in modules.items():
        try:
            os.mkdir(os.path.join(folder, name.replace("/", "__")))
        except FileExistsError:
            continue
        began = os.times()
        for i, item in enumerate(items):
            # the module's last test tears its fixtures down (the next one may be elsewhere)
            nextitem = items[i + 1] if i + 1 < len(items) else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        ended = os.times()
        cpu = sum(ended[:4]) - sum(began[:4])   # this process's and its children's CPU time
        with open(os.path.join(folder, "ran"), "a") as log:
            log.write(f"{os.getpid()} {name} {len(items)} {ended.elapsed - began.elapsed:.1f} {cpu:.1f}\n")
    return True
