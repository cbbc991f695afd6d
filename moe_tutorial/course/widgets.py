"""The chapters' interactive pieces: `predict` (the learner commits to a guess, the measurement
grades it) and the routing-skew explorer (a slider over `perf.skew`'s costs), and the names a
chapter's cells reach through `widgets.`: the live dashboard (`dashboard.LiveDashboard`) and the
static tables and figures (`moe_tutorial.display`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from .. import display
from ..display import Table, plotly_go, show_figure, show_table
from .dashboard import LiveDashboard, live_support

__all__ = ["LiveDashboard", "Prediction", "SkewExplorer", "Table", "live_support", "plotly_go",
           "predict", "show_figure", "show_table", "skew_explorer"]

# ---------------------------------------------------------------------------------------------
# Predict, then measure

class Prediction:
    """A question the learner answers before a measurement, graded by it in one sentence.

        guess = predict("Will FP8 be faster than bf16 at hidden 128?", ["yes", "no"])
        ...                                          # the measurement
        guess.grade("no" if fp8_ms > bf16_ms else "yes", f"FP8 {fp8_ms:.1f} ms, bf16 {bf16_ms:.1f} ms")

    It starts unanswered: nothing is preselected, so a guess is always the learner's own. With a
    Jupyter frontend attached the question is a row of buttons (a drop-down of the numbers, for
    a `range`), none pressed, and the grade follows the answer: pick one, or change it after the
    measurement, and the sentence changes. Headless (papermill, nbval, a script) nobody can
    answer: the grade says "not answered yet" and still shows what the measurement says and why,
    and nothing waits for input."""

    def __init__(self, question: str, choices, *, live: bool = True):
        numeric = isinstance(choices, range)
        if numeric:
            if len(choices) < 2:
                raise ValueError(f"a prediction needs two or more choices; got {choices!r}")
        else:
            choices = [str(c) for c in choices]
            if len(choices) < 2 or len(set(choices)) != len(choices):
                raise ValueError(f"a prediction needs two or more distinct choices; got {choices}")
        self.question, self.choices = question, choices
        self._widget = self._output = None
        self._graded: tuple | None = None
        if live and live_support()[0]:
            import ipywidgets

            if numeric:
                self._widget = ipywidgets.Dropdown(options=list(choices), value=None,
                                                   description="your guess")
            else:
                self._widget = ipywidgets.ToggleButtons(options=choices, value=None)
            display.show_raw(ipywidgets.VBox([ipywidgets.HTML(f"<b>Predict:</b> {question}"),
                                      self._widget]))
        else:
            options = (f"a number in {choices.start}..{choices.stop - 1}" if numeric
                       else " / ".join(choices))
            print(f"Predict: {question} ({options})\n"
                  f"  [a headless run has no one to answer: it stays unanswered]")

    @property
    def answer(self):
        """The learner's answer, or None while nothing is picked."""
        return self._widget.value if self._widget is not None else None

    def grade(self, truth, why: str, *, tolerance: float = 0) -> None:
        """Say whether the answer matches `truth` (a choice, or a number within `tolerance`),
        with `why`: what the measurement showed; `right` then holds whether it matched (None
        while unanswered). (It returns nothing: a `True` / `False` would print under a notebook
        cell ending in it.)"""
        self._graded = (truth, why, tolerance)
        if self._widget is not None and self._output is None:
            import ipywidgets

            self._output = ipywidgets.HTML()
            self._widget.observe(lambda _: self._render(), names="value")
            display.show_raw(self._output)
        self._render()

    @property
    def right(self) -> bool | None:
        """Whether the answer (as it is now) matches the measurement, None while unanswered;
        `grade` first."""
        if self._graded is None:
            raise RuntimeError("grade(truth, why) the prediction before asking whether it was right")
        truth, _, tolerance = self._graded
        if self.answer is None:
            return None
        if isinstance(self.choices, range):
            return abs(self.answer - truth) <= tolerance
        return self.answer == str(truth)

    @property
    def verdict(self) -> str:
        """'right', 'not this time' or 'not answered yet', for a summary table; `grade` first."""
        return {True: "right", False: "not this time", None: "not answered yet"}[self.right]

    def _render(self) -> None:
        truth, why, _ = self._graded
        if self.answer is None:
            sentence = f"– Not answered yet: the measurement says {truth!r}. {why}"
        else:
            sentence = (f"{'✓ Right' if self.right else '✗ Not this time'}: you predicted "
                        f"{self.answer!r}, the measurement says {truth!r}. {why}")
        if self._output is not None:
            self._output.value = f"<p>{html.escape(sentence)}</p>"
        else:
            print(sentence)


def predict(question: str, choices, *, live: bool = True) -> Prediction:
    """Ask `question` before a measurement (`choices`: a list of answers, or a `range` for a
    number), unanswered until the learner picks; grade it after with `.grade(truth, why)`. See
    `Prediction`."""
    return Prediction(question, choices, live=live)


# ---------------------------------------------------------------------------------------------
# Routing skew, explored with a slider

SKEW_SLIDER_CLASS = "moe-skew-slider"  # CSS classes a browser test finds the explorer by
SKEW_OUTPUT_CLASS = "moe-skew-output"
SKEW_EXPLORER_CLASS = "moe-skew-explorer"


class SkewExplorer:
    """A slider from balanced routing (0) to one hot expert (1) and what that skew costs, for
    `tokens` tokens routed to `top_k` of `num_experts` experts of size `hidden` × `intermediate`:
    the token copies per expert, the padding waste per alignment, the expert-parallel straggler
    wait per `ep`, and the grouped GEMMs' rate against balanced routing, measured on `device`
    (all from `moe_tutorial.perf.skew`). A plotly figure and a `Table` show them.

        explorer = skew_explorer(4096, 8, 2, 128, 256, device=SETUP.device)

    With a Jupyter frontend attached (see `live_support`) the slider redraws the output when it
    is released (`continuous_update=False`); every skew is measured once and cached, so going
    back is instant. Headless (papermill, nbval, a script) nobody moves it, so the explorer draws
    once at `default_skew`, says it is static and why, and waits for nothing.

    ep          expert-parallel sizes to show the straggler wait for (default: 2 and 4 where
                they divide num_experts)
    alignments  rows-per-expert alignments to show the padding waste for
    iters       timed calls per measurement (median; each skew also times balanced routing)
    """

    def __init__(self, tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 *, ep: int | Sequence[int] | None = None, alignments: Sequence[int] | None = None,
                 device="cpu", dtype=None, default_skew: float = 0.0, step: float = 0.05,
                 iters: int = 5, live: bool = True):
        from ..perf import skew  # skew imports torch; tables load without it

        self.tokens, self.num_experts, self.top_k = tokens, num_experts, top_k
        self.hidden, self.intermediate = hidden, intermediate
        self.device, self.dtype, self.iters = device, dtype, iters
        self.alignments = skew.DEFAULT_ALIGNMENTS if alignments is None else tuple(alignments)
        if ep is None:
            ep = [size for size in (2, 4) if size <= num_experts and num_experts % size == 0]
        self.eps = (ep,) if isinstance(ep, int) else tuple(ep)
        if not 0 < step <= 1:
            raise ValueError(f"step={step!r} must be in (0, 1]: the slider's increment of skew")
        # Everything that skew refuses is refused now, before anything is drawn.
        self._balanced = self._routing_costs(skew.skewed_splits(tokens, num_experts, top_k, 0.0))
        skew.skewed_splits(tokens, num_experts, top_k, default_skew)
        self.results: dict[float, dict] = {}  # skew -> measure(skew), the cache
        self.skew = default_skew
        self.live, self.off_reason = False, ""
        self.slider = self.output = self._widget = None
        ok, why = live_support() if live else (False, "live=False")
        if ok:
            self._start_live(step)
        else:
            self.off_reason = why
            if live and display.in_kernel():  # a slider was asked for and cannot be had: say why, once
                print(f"skew explorer static at skew {default_skew:.2f}: {why}; with a Jupyter "
                      f"frontend attached its slider redraws this.")
            self._show_static()

    # --- numbers ---------------------------------------------------------------------------
    def _routing_costs(self, splits: list[int]) -> dict:
        from ..perf import skew  # skew imports torch; tables load without it

        return {"splits": splits, "padding": skew.padding_waste(splits, self.alignments),
                "stragglers": {size: skew.straggler_wait(splits, size) for size in self.eps}}

    def measure(self, skew_value: float) -> dict:
        """Everything the explorer shows at `skew_value` (cached): "skew", "splits", "padding"
        (per alignment), "stragglers" (per ep), "gemm" (`skew.grouped_gemm_efficiency`), and
        "balanced": the splits, padding and stragglers of balanced routing."""
        from ..perf import skew  # skew imports torch; tables load without it

        key = round(float(skew_value), 6)
        if key not in self.results:
            splits = skew.skewed_splits(self.tokens, self.num_experts, self.top_k, key)
            gemm = skew.grouped_gemm_efficiency(splits, self.hidden, self.intermediate,
                                                device=self.device, dtype=self.dtype,
                                                iters=self.iters)
            self.results[key] = {"skew": key, **self._routing_costs(splits), "gemm": gemm,
                                 "balanced": self._balanced}
        return self.results[key]

    def table(self, skew_value: float | None = None) -> display.Table:
        """The numbers at `skew_value` (default: the slider's) next to balanced routing's."""
        r = self.measure(self.skew if skew_value is None else skew_value)
        balanced, gemm = r["balanced"], r["gemm"]

        def padding(costs, align):
            waste = costs["padding"][align]
            return f"{waste['padding_rows']:,} rows ({waste['fraction']:.1%})"

        def wait(costs, size):
            s = costs["stragglers"][size]
            return f"{s['wait']:.1%} (rows per rank {'/'.join(map(str, s['rows_per_rank']))})"

        rows = [["token copies of expert 0 (the hot one)",
                 f"{r['splits'][0]:,} of {self.tokens:,} tokens", f"{balanced['splits'][0]:,}"]]
        rows += [[f"padding at alignment {a}", padding(r, a), padding(balanced, a)]
                 for a in self.alignments]
        rows += [[f"straggler wait, ep={size}", wait(r, size), wait(balanced, size)]
                 for size in self.eps]
        rows += [["grouped GEMMs, forward",
                  f"{gemm['skewed_ms']:.2f} ms, {gemm['skewed_tflops']:.3g} TFLOP/s",
                  f"{gemm['balanced_ms']:.2f} ms, {gemm['balanced_tflops']:.3g} TFLOP/s"],
                 ["GEMM efficiency (balanced ms / this ms)", f"{gemm['efficiency']:.2f}", "1.00"]]
        mode = ("live: move the slider" if self.live
                else f"static ({self.off_reason.split(' (')[0]})")
        note = (f"measured here: {gemm['path']}, {gemm['dtype']}, median of {self.iters} "
                f"({gemm['timer']}), interleaved with balanced routing; the straggler wait "
                f"assumes time ∝ rows. Explorer: {mode}.")
        return display.Table(["", "this skew", "balanced routing"], rows, note=note,
                     title=f"routing skew {r['skew']:.2f}: {self.tokens:,} tokens, "
                           f"top-{self.top_k} of {self.num_experts} experts")

    def figure(self, skew_value: float | None = None):
        """A static plotly figure of the numbers at `skew_value` (None without plotly)."""
        go = display.plotly_go()
        if go is None:
            return None
        from plotly.subplots import make_subplots

        r = self.measure(self.skew if skew_value is None else skew_value)
        gemm = r["gemm"]
        fig = go.Figure(make_subplots(rows=1, cols=4, horizontal_spacing=0.07, subplot_titles=[
            "token copies per expert", "padding, % of rows", "EP straggler wait, % idle",
            f"GEMM TFLOP/s (efficiency {gemm['efficiency']:.2f})"]))
        fig.add_trace(go.Bar(x=list(range(self.num_experts)), y=r["splits"], name="this skew",
                             marker_color=display.PALETTE[1], showlegend=False), row=1, col=1)
        fig.add_hline(y=self.tokens * self.top_k / self.num_experts, row=1, col=1,
                      line=dict(color="gray", dash="dot"), annotation_text="balanced")
        fig.add_trace(go.Bar(x=[f"align {a}" for a in self.alignments],
                             y=[100 * r["padding"][a]["fraction"] for a in self.alignments],
                             marker_color=display.PALETTE[3], showlegend=False), row=1, col=2)
        fig.add_trace(go.Bar(x=[f"ep={size}" for size in self.eps],
                             y=[100 * r["stragglers"][size]["wait"] for size in self.eps],
                             marker_color=display.PALETTE[4], showlegend=False), row=1, col=3)
        fig.add_trace(go.Bar(x=["balanced", "this skew"],
                             y=[gemm["balanced_tflops"], gemm["skewed_tflops"]],
                             marker_color=[display.PALETTE[0], display.PALETTE[1]], showlegend=False), row=1, col=4)
        # Fixed ranges where the bound is known, so moving the slider moves the bars, not the axes.
        fig.update_yaxes(range=[0, self.tokens * 1.05], row=1, col=1)
        fig.update_yaxes(range=[0, 100], row=1, col=3)
        fig.update_xaxes(title_text="expert", row=1, col=1)
        fig.update_annotations(font_size=13)  # the panel titles: four side by side
        fig.update_layout(title=dict(text=f"routing skew {r['skew']:.2f}"), height=360,
                          margin=dict(t=80, b=50), template="plotly_white")
        return fig

    # --- drawing ---------------------------------------------------------------------------
    def _show_static(self) -> None:
        fig = self.figure()
        display.show_figure(fig)
        display.show_table(self.table())

    def _outputs(self) -> tuple[dict, ...]:
        """The output widget's content at the slider's skew: the figure and the table."""
        fig = self.figure()
        bundles = ([display.figure_bundle(fig)] if fig is not None else []) + [self.table()._repr_mimebundle_()]
        return tuple({"output_type": "display_data", "data": b, "metadata": {}} for b in bundles)

    def _start_live(self, step: float) -> None:
        import ipywidgets

        self.slider = ipywidgets.FloatSlider(
            value=self.skew, min=0.0, max=1.0, step=step, continuous_update=False,
            readout_format=".2f", description="routing skew: balanced → one hot expert",
            style={"description_width": "initial"}, layout=ipywidgets.Layout(width="640px"))
        self.slider.add_class(SKEW_SLIDER_CLASS)
        self.output = ipywidgets.Output()
        self.output.add_class(SKEW_OUTPUT_CLASS)
        self._widget = ipywidgets.VBox([self.slider, self.output])
        self._widget.add_class(SKEW_EXPLORER_CLASS)
        self.live = True
        self.output.outputs = self._outputs()
        self.slider.observe(self._on_slider, names="value")
        display.show_raw(self._widget)

    def _on_slider(self, change) -> None:
        """Redraw at the slider's new value. A failure is shown in the output: raised inside a
        widget callback it would only reach the frontend's log, where nobody looks."""
        self.skew = change["new"]
        try:
            self.output.outputs = self._outputs()
        except Exception as exc:
            self.output.outputs = ({"output_type": "stream", "name": "stderr",
                                    "text": f"skew {self.skew:.2f} could not be measured: "
                                            f"{type(exc).__name__}: {exc}\n"},)


def skew_explorer(tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                  **options) -> SkewExplorer:
    """Show a routing-skew slider and what skew costs here (see `SkewExplorer` for `options`)."""
    return SkewExplorer(tokens, num_experts, top_k, hidden, intermediate, **options)

