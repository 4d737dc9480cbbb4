"""The plan room: pure data and rules, importable without CUDA or any FP8 backend."""

from fp8stack.plan.description import Component, ModelDescription, description_from_dict, load_description
from fp8stack.plan.errors import PlanError, PlanWarning
from fp8stack.plan.plan import Decision, Fusion, Plan
from fp8stack.plan.policy import Override, PolicyConfig, make_plan
from fp8stack.plan.recipe_file import load_recipe_file
from fp8stack.plan.recipes import RECIPES, parse_arch

__all__ = ["Component", "Decision", "Fusion", "ModelDescription", "Override", "Plan", "PlanError", "PlanWarning",
           "PolicyConfig", "RECIPES", "description_from_dict", "load_description",
           "load_recipe_file", "make_plan", "parse_arch"]
