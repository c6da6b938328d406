from rota.cli.app import main

main()
