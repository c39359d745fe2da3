"""Tools built on the model, behind the `dsv4cp` commands: `checking` (CP=N vs CP=1), `accuracy`
(a server against the runner), `export_tiny` (a servable tiny checkpoint). Nothing on the
model's path imports them."""
