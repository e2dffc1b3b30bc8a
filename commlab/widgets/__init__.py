"""Interactive calculators for the chapters, each with a static figure for the online book.

* :mod:`commlab.widgets.calculator` -- AllReduce time, algbw and busbw per algorithm (chapter 3).

The table and curve helpers are pure functions; only :func:`calculator` needs ipywidgets.
"""

from commlab.widgets.calculator import (ASSUMED_SWITCH_ALPHA_S, Row, allreduce_table, calculator, static_figure,
                                        table_for_preset, table_html, table_text, time_curves)

__all__ = ["Row", "ASSUMED_SWITCH_ALPHA_S", "allreduce_table", "table_for_preset", "time_curves", "table_text",
           "table_html", "calculator", "static_figure"]
