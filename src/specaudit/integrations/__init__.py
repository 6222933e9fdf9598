"""specaudit inside the routers people already run. `specaudit.integrations.litellm` (extra
``specaudit[litellm]``): role-aware routing and placeholder checks as a LiteLLM callback."""
