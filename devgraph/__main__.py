from devgraph.cli import main

raise SystemExit(main())
