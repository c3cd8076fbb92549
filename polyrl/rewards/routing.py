"""Which terms score a data source (the rule docs/rewards.md states):

1. reward.combine.<data_source>, else reward.combine."*": a weighted sum of terms;
2. the one scorer (reward.custom_function / reward.http / reward.model / reward.judge) whose `sources` list it;
3. the one scorer whose `sources` is null (RewardConfig allows at most one without combine."*");
4. the built-in verifier registered for the data source (polyrl/rewards/registry.py).

A single scorer is a one-term sum of weight 1, so the manager has one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from polyrl.rewards.config import RewardConfig, RewardTerm
from polyrl.rewards.functions import FunctionScorer, make_scorer
from polyrl.rewards.gsm8k import gsm8k_score
from polyrl.rewards.registry import REWARD_FNS, UnknownDataSourceError, load_function

Kind = Literal["function", "model", "http", "judge"]
KIND_OF = {"reward.custom_function": "function", "reward.http": "http", "reward.model": "model",
           "reward.judge": "judge"}


@dataclass(frozen=True)
class Term:
    kind: Kind
    weight: float
    label: str
    fn: FunctionScorer | None = None
    """kind=function: the function to call."""


class Router:
    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self._custom: FunctionScorer | None = None
        if cfg.custom_function:
            self._custom = make_scorer(load_function(cfg.custom_function),
                                       dict(cfg.custom_function_kwargs),
                                       who=f"reward.custom_function={cfg.custom_function}")
        self._named: dict[tuple[str, str], FunctionScorer] = {}
        for terms in cfg.combine.values():  # load now: a bad module fails at start
            for term in terms:
                if term.function is not None:
                    self._named_function(term)
        self._plans: dict[str, tuple[Term, ...]] = {}

    def terms_for(self, data_source: str) -> tuple[Term, ...]:
        """The terms that score `data_source`; raises UnknownDataSourceError if none do."""
        plan = self._plans.get(data_source)
        if plan is None:
            plan = self._plan(data_source)
            self._plans[data_source] = plan
        return plan

    def _plan(self, source: str) -> tuple[Term, ...]:
        terms = self.cfg.combine.get(source, self.cfg.combine.get("*"))
        if terms is not None:
            return tuple(self._term(source, t) for t in terms)
        routes = self.cfg.routes()
        listed = [key for key, sources in routes.items() if sources and source in sources]
        catch_all = [key for key, sources in routes.items() if sources is None]
        for key in listed or catch_all:
            kind = KIND_OF[key]
            fn = self._custom if kind == "function" else None
            return (Term(kind, 1.0, kind, fn),)
        return (Term("function", 1.0, "function", self._builtin(source)),)

    def _term(self, source: str, term: RewardTerm) -> Term:
        if term.kind != "function":
            return Term(term.kind, term.weight, term.label)
        fn = self._named_function(term) if term.function else self.own_function(source)
        return Term("function", term.weight, term.label, fn)

    def own_function(self, source: str) -> FunctionScorer:
        """The function that scores `source` alone: the custom one where it routes the source,
        else the built-in verifier."""
        listed = self.cfg.custom_function_sources
        if self._custom is not None and (listed is None or source in listed):
            return self._custom
        return self._builtin(source)

    def _builtin(self, source: str) -> FunctionScorer:
        if source not in REWARD_FNS:
            raise UnknownDataSourceError(source)
        fn = REWARD_FNS.get(source)
        options = {"method": self.cfg.gsm8k_method} if fn is gsm8k_score else {}
        return make_scorer(fn, options)

    def _named_function(self, term: RewardTerm) -> FunctionScorer:
        key = (term.function, repr(sorted(term.kwargs.items())))
        if key not in self._named:
            try:
                fn = load_function(term.function)
            except ValueError as exc:  # its message names reward.custom_function: rename
                raise ValueError(str(exc).replace("reward.custom_function",
                                                  f"reward.combine term function '{term.function}'")) from None
            self._named[key] = make_scorer(fn, dict(term.kwargs),
                                           who=f"reward.combine term function '{term.function}'")
        return self._named[key]
