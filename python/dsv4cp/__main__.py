from dsv4cp.cli import main

raise SystemExit(main())
