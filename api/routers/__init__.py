"""One router per resource: embed, openai, models, tasks, health."""
