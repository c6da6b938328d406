from rota.cli import main

main()
