from .start import main

main()
