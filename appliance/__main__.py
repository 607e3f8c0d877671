import multiprocessing

from appliance.cli import main

multiprocessing.freeze_support()    # a frozen binary's prepare-pool children start here
raise SystemExit(main())
