"""The ``/hoplite`` dashboard page.

* :mod:`.state`: what the page shows, built from plain inputs (pure);
* :mod:`.live`: those inputs, read from the running scheduler part;
* :mod:`.page`: the Bokeh document and the tornado routes (``/hoplite``,
  ``/hoplite.json``) on the scheduler's HTTP server.
"""
