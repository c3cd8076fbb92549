from polyrl.cli.main import main

raise SystemExit(main())
