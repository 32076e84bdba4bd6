from freetoken.cli.main import main

raise SystemExit(main())
